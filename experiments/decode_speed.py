"""Decoding speed of specdec's loop against Hugging Face `generate`: the race behind scripts/bench_decode.py.

Owns `parse` (bad options exit before anything loads), `load_prompts`, `hf_generate`, `configurations`, `race`,
`rows` and `by_category`. Knows nothing about tuning, printing or records.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

import specdec
from specdec.core.metrics import GenerationStats
from specdec.core.shapes import parse_shape
from specdec.drafters import build
from specdec.drafters.registry import parse_specs
from specdec.loading import check_device
from specdec.runtime import kernels

ROOT = Path(__file__).resolve().parents[1]
PROMPT_SETS = {"chat_heldout": ROOT / "experiments" / "prompts" / "chat_heldout.jsonl"}


def parse(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    """The options, checked: `shapes` ({spec: ShapeSpec}) and `drafter_specs` ([(name, options)]) parsed,
    the device and the drafter names known (SystemExit naming the option otherwise)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="e.g. float32, bfloat16 (default: the model's)")
    parser.add_argument("--quant", default=None, help="a quant spec, e.g. torchao_int4_g32 (default: none)")
    parser.add_argument("--kernel", default="auto", choices=kernels.CHOICES,
                        help="linear kernel of the target (specdec.runtime.kernels); HF runs on the same model")
    parser.add_argument("--drafters", default="eagle,ngram",
                        help="comma-separated registered drafters, each optionally NAME[k=v,...] with its options")
    parser.add_argument("--shapes", default="chain(4);dynamic(8,6,32);auto", help="semicolon-separated shapes")
    parser.add_argument("--prompts", default="chat_heldout")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-lookup", type=int, default=10, help="HF prompt_lookup_num_tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cache", default="auto", help="auto or a key of specdec.runtime.forwards.CACHES")
    parser.add_argument("--latency", default="", help="comma-separated widths: print the latency curve first")
    parser.add_argument("--by-category", action="store_true", help="--num-prompts per category, no HF runs: each "
                        "drafter's `auto` against plain and its best fixed shape, per category (never slower?)")
    args = parser.parse_args(argv)
    try:
        check_device(args.device)
    except ValueError as err:
        raise SystemExit(f"error: --device: {err}") from None
    try:
        args.shapes = {s.strip(): parse_shape(s) for s in args.shapes.split(";") if s.strip()}
    except ValueError as err:
        raise SystemExit(f"error: --shapes: {err}") from None
    try:
        args.drafter_specs = parse_specs(args.drafters)
    except ValueError as err:
        raise SystemExit(f"error: --drafters: {err}") from None
    unknown = [name for name, _ in args.drafter_specs if name not in specdec.drafters.names()]
    if unknown:
        raise SystemExit(f"error: unknown drafters {unknown}; registered: {', '.join(specdec.drafters.names())}")
    return args


def load_prompts(spec: str, count: int, per_category: bool = False) -> list[str] | list[tuple[str, str]]:
    """First turns of the prompts named by `spec` (see the module docstring), at most `count`; `per_category`:
    [(category, turn)], at most `count` of each category."""
    path, _, categories = spec.partition(":")
    file = PROMPT_SETS.get(path, Path(path))
    if not file.exists():
        raise SystemExit(f"error: prompt set {path!r} is neither {', '.join(PROMPT_SETS)} nor an existing file")
    wanted = {c for c in categories.split(",") if c}
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    prompts = [(r.get("category", ""), r["turns"][0]) for r in rows if not wanted or r.get("category") in wanted]
    if not prompts:
        raise SystemExit(f"error: no prompts in {file} with categories {sorted(wanted)}")
    if per_category:
        return [p for c in dict.fromkeys(c for c, _ in prompts) for p in [q for q in prompts if q[0] == c][:count]]
    return [turn for _, turn in prompts[:count]]


def hf_generate(target: specdec.Target, ids: list[int], new_tokens: int, **options) -> list[int]:
    """HF `generate` greedy: exactly `new_tokens` argmax tokens with EOS neither stopping nor suppressed
    (`eos_token_id=None`; `min_new_tokens` would mask it), as `specdec.generate(..., stop_on_eos=False)`."""
    x = torch.tensor([ids], device=target.device)  # [1, L]
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None, **options)
    tokens = out[0, x.shape[1]:].tolist()
    if len(tokens) != new_tokens:
        raise RuntimeError(f"HF generate returned {len(tokens)} tokens, expected {new_tokens}")
    return tokens


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (the shorter one's length when one is a
    prefix of the other), None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def configurations(target, args, cache: str) -> dict:
    """{name: run(ids) -> (tokens, stats or None)}: HF generate, HF prompt lookup, our plain loop (and their
    torch-kernel and dynamic-cache variants when those differ), then each drafter x shape of `args`."""
    n = args.new_tokens

    def hf(ids: list[int], **options) -> tuple[list[int], None]:
        return hf_generate(target, ids, n, **options), None

    def ours(drafter, shape, kind=cache):
        def run(ids):
            out = specdec.generate(target, drafter, ids, shape=shape, max_new_tokens=n, stop_on_eos=False, cache=kind)
            return out.token_ids, out.stats
        return run

    def hf_stock(ids: list[int]) -> tuple[list[int], None]:
        with kernels.plain_linears(target.model):  # the same weights in transformers' own nn.Linear
            return hf(ids)

    configs = {"plain": ours(None, "chain(1)")}
    if not args.by_category:  # --by-category races our loop only
        configs = {"hf_generate": hf, "hf_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=args.hf_lookup),
                   **configs}
        if target.kernel != "torch":
            configs["hf_generate[torch kernel]"] = hf_stock
    if cache != "dynamic" and not args.by_category:
        configs["plain[cache=dynamic]"] = ours(None, "chain(1)", "dynamic")
    for name, options in args.drafter_specs:
        drafter = build(name, target=target, **options)
        label = name + ("[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]" if options else "")
        for spec, shape in args.shapes.items():
            configs[f"{label} {spec}"] = ours(drafter, shape)
    return configs


def race(target, configs: dict, prompt_ids: list[list[int]]) -> dict[str, dict]:
    """Every configuration on every prompt, back to back per prompt in an order rotated by one each prompt, after an
    untimed warm-up: {name: {seconds, tokens, per_prompt (tokens/s each), same (outputs equal to plain's), parted
    (first differing token of each other output), stats}}."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    for run in configs.values():  # warm-up (and auto's one-time latency measurement), not timed
        run(prompt_ids[0][:16])
    got = {name: {"seconds": 0.0, "tokens": 0, "per_prompt": [], "same": 0, "parted": [], "stats": []}
           for name in configs}
    names = list(configs)
    for i, ids in enumerate(prompt_ids):
        outs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            sync()
            t0 = time.perf_counter()
            outs[name], st = configs[name](ids)
            sync()
            seconds = time.perf_counter() - t0
            got[name]["seconds"] += seconds
            got[name]["tokens"] += len(outs[name])
            got[name]["per_prompt"].append(len(outs[name]) / seconds)
            if st is not None:
                got[name]["stats"].append(st)
        for name in names:
            differs = first_difference(outs[name], outs["plain"])
            got[name]["same"] += differs is None
            if differs is not None:
                got[name]["parted"].append(differs)
    return got


def rows(got: dict[str, dict]) -> list[dict]:
    """One row per configuration: tokens/s, ratios to HF generate and HF prompt lookup, outputs equal to
    plain's, first differing tokens, and (our loop) MAL, the step-time split and the shapes run."""
    tps = {name: g["tokens"] / g["seconds"] for name, g in got.items()}
    out = []
    for name, g in got.items():
        row = {"config": name, "tokens_per_s": tps[name], "vs_hf_generate": tps[name] / tps.get("hf_generate", math.nan),
               "vs_hf_prompt_lookup": tps[name] / tps.get("hf_prompt_lookup", math.nan),
               "identical_to_plain": g["same"], "first_difference": sorted(g["parted"])}
        if g["stats"]:
            merged = GenerationStats.merge(g["stats"])
            row.update(mal=merged.mean_acceptance_length, split=merged.time_split(),
                       shapes=sorted({s.shape or "none" for s in merged.steps}))
        out.append(row)
    return out


def by_category(got: dict[str, dict], categories: list[str]) -> list[dict]:
    """Per category and drafter (each configuration `LABEL auto` beside `LABEL SHAPE`s): `auto`'s tokens/s over
    plain's and over the fixed shape fastest in that category, mean per prompt with a 95% t-interval
    (`specdec.measure.width_effect.mean_ci`), and `never_slower`: the means at least 1.0 and 0.95."""
    from specdec.measure.width_effect import mean_ci

    table = []
    for category in dict.fromkeys(categories):
        idx = [i for i, c in enumerate(categories) if c == category]
        rate = {name: [g["per_prompt"][i] for i in idx] for name, g in got.items()}
        for label in dict.fromkeys(n.rsplit(" ", 1)[0] for n in got if n.endswith(" auto")):
            fixed = [n for n in got if n.startswith(label + " ") and n != f"{label} auto"]
            best = max(fixed, key=lambda n: sum(rate[n]))
            row = {"category": category, "drafter": label, "prompts": len(idx), "best_fixed": best.split(" ", 1)[1]}
            for key, base in (("vs_plain", "plain"), ("vs_best_fixed", best)):
                ratios = [a / b for a, b in zip(rate[f"{label} auto"], rate[base])]
                row[key] = list(mean_ci(ratios)) if len(ratios) > 1 else [ratios[0]] * 3
            row["never_slower"] = row["vs_plain"][0] >= 1.0 and row["vs_best_fixed"][0] >= 0.95
            table.append(row)
    return table
