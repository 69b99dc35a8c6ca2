"""Decoding speed: specdec's loop (plain and with drafters x shapes) against Hugging Face `generate`.

Same target, prompts, lengths and greedy decoding. For every prompt all configurations run back to
back (HF generate, HF prompt lookup, our plain loop, then each drafter x shape), so machine noise
hits them alike. HF runs on the target's own model, so with its linear kernel (`--kernel`, default
`auto`); when that is not `torch`, `hf_generate[torch kernel]` also runs HF on the same weights in
transformers' own `nn.Linear`s (what a plain transformers user gets). Prints a card per
configuration: tokens/s, ratio to HF `generate` greedy and to HF prompt lookup
(`prompt_lookup_num_tokens`), mean acceptance length (MAL), the split of step time into target
forward / draft (propose + commit) / everything else, and how many outputs equal our plain loop's
(for those that differ, the first token that does); then one JSON line. Not a test: a measurement.

    python scripts/bench_decode.py [--model smollm2-135m] [--device cpu] [--kernel auto]
        [--drafters "eagle,eagle[head_dtype=bfloat16],ngram"]
        [--shapes "chain(4);dynamic(8,6,32);auto"] [--prompts chat_heldout] [--num-prompts 6]
        [--new-tokens 64] [--threads 1] [--cache auto] [--latency 1,2,4,...,128]

--cache: the loop's (cache, forward) pair (`specdec.runtime.forwards.CACHES`; `auto` = `graphs`, the CUDA
graph fast path, on CUDA, else `dynamic`); when it is not `dynamic`, a `plain[cache=dynamic]` row
runs the plain loop without it, for comparison. --latency W,W,...: first print the target's forward
time per width through that pair and through `dynamic` (`specdec.measure.latency.measure_latency`, 256
cached tokens).

--prompts: `chat_heldout` (experiments/prompts/chat_heldout.jsonl: chat prompts no training or
evaluation set contains) or `FILE.jsonl[:category,category]` (e.g.
`experiments/prompts/default.jsonl:retrieval,summarization`); the first turn of each prompt is used.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import specdec
from specdec.measure import records
from specdec.runtime import kernels
from specdec.drafters import build
from specdec.drafters.registry import parse_specs
from specdec.runtime.forwards import resolve_cache
from specdec.machine import machine_name
from specdec.measure.latency import measure_latency
from specdec.loading import check_device
from specdec.core.metrics import GenerationStats
from specdec.core.shapes import parse_shape
from specdec.tune import ensure_tuned

ROOT = Path(__file__).resolve().parents[1]
PROMPT_SETS = {"chat_heldout": ROOT / "experiments" / "prompts" / "chat_heldout.jsonl"}


def load_prompts(spec: str, count: int) -> list[str]:
    """First turns of the prompts named by `spec` (see the module docstring), at most `count`."""
    path, _, categories = spec.partition(":")
    file = PROMPT_SETS.get(path, Path(path))
    if not file.exists():
        raise SystemExit(f"error: prompt set {path!r} is neither {', '.join(PROMPT_SETS)} nor an existing file")
    wanted = {c for c in categories.split(",") if c}
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    prompts = [r["turns"][0] for r in rows if not wanted or r.get("category") in wanted]
    if not prompts:
        raise SystemExit(f"error: no prompts in {file} with categories {sorted(wanted)}")
    return prompts[:count]


def hf_generate(target: specdec.Target, ids: list[int], new_tokens: int, **options) -> list[int]:
    """HF `generate` greedy: exactly `new_tokens` argmax tokens, EOS neither stopping nor suppressed,
    i.e. the rule of `specdec.generate(..., stop_on_eos=False)`. (`min_new_tokens` would mask EOS out
    of the logits, so HF would take the runner-up wherever EOS is the argmax and the outputs would
    part there; `eos_token_id=None` turns off the stop instead.) `options` go to `generate` as is."""
    x = torch.tensor([ids], device=target.device)  # [1, L]
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None, **options)
    tokens = out[0, x.shape[1]:].tolist()
    if len(tokens) != new_tokens:
        raise RuntimeError(f"HF generate returned {len(tokens)} tokens, expected {new_tokens}")
    return tokens


def print_latency(target: specdec.Target, widths: tuple[int, ...], cache: str) -> None:
    """The target's forward time per width after 256 cached tokens, through `cache` and `dynamic`."""
    kinds = dict.fromkeys([cache, "dynamic"])
    curves = {kind: measure_latency(target, widths, (256,), repeats=5, cache=kind) for kind in kinds}
    print(f"== latency ({target.label}, {target.dtype}, {target.device}, 256 cached tokens, median of 5): ms per forward")
    print("   " + f"{'width':>6s}" + "".join(f"{kind:>10s}" for kind in kinds))
    for w in widths:
        print("   " + f"{w:6d}" + "".join(f"{curves[kind].at(w) * 1e3:10.2f}" for kind in kinds))
    records.emit("latency", {"bench": "latency", "model": target.label, "device": str(target.device), "widths": list(widths),
                      "ms": {kind: [curves[kind].at(w) * 1e3 for w in widths] for kind in kinds}}, device=str(target.device))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (the shorter one's length when one is a
    prefix of the other), None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="e.g. float32, bfloat16 (default: the model's)")
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
    args = parser.parse_args(argv)
    try:
        check_device(args.device)
    except ValueError as err:
        raise SystemExit(f"error: --device: {err}") from None
    try:
        shapes = {s.strip(): parse_shape(s) for s in args.shapes.split(";") if s.strip()}
    except ValueError as err:
        raise SystemExit(f"error: --shapes: {err}") from None
    try:
        drafter_specs = parse_specs(args.drafters)
    except ValueError as err:
        raise SystemExit(f"error: --drafters: {err}") from None
    unknown = [name for name, _ in drafter_specs if name not in specdec.drafters.names()]
    if unknown:
        raise SystemExit(f"error: unknown drafters {unknown}; registered: {', '.join(specdec.drafters.names())}")
    prompts = load_prompts(args.prompts, args.num_prompts)
    if args.device == "cpu" and args.dtype in (None, "float32") and args.kernel == "auto":
        ensure_tuned(args.model, args.threads)
    target = specdec.load_target(args.model, device=args.device, dtype=args.dtype, kernel=args.kernel,
                                 threads=args.threads)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    n = args.new_tokens
    try:
        cache = resolve_cache(args.cache, target)
        widths = tuple(int(w) for w in args.latency.split(",") if w.strip())
    except ValueError as err:
        raise SystemExit(f"error: --cache / --latency: {err}") from None
    if widths:
        print_latency(target, widths, cache)

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

    configs = {"hf_generate": hf, "hf_prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=args.hf_lookup),
               "plain": ours(None, "chain(1)")}
    if target.kernel != "torch":
        configs["hf_generate[torch kernel]"] = hf_stock
    if cache != "dynamic":
        configs["plain[cache=dynamic]"] = ours(None, "chain(1)", "dynamic")
    for name, options in drafter_specs:
        drafter = build(name, target=target, **options)
        label = name + ("[" + ",".join(f"{k}={v}" for k, v in options.items()) + "]" if options else "")
        for spec, shape in shapes.items():
            configs[f"{label} {spec}"] = ours(drafter, shape)

    prompt_ids = [target.encode_prompt(p) for p in prompts]
    for run in configs.values():  # warm-up (and auto's one-time latency measurement), not timed
        run(prompt_ids[0][:16])
    seconds = dict.fromkeys(configs, 0.0)
    tokens = dict.fromkeys(configs, 0)
    same = dict.fromkeys(configs, 0)
    parted = {name: [] for name in configs}  # per prompt whose output differs from plain's: the first differing token
    stats = {name: [] for name in configs}
    for ids in prompt_ids:
        outs = {}
        for name, run in configs.items():
            sync()
            t0 = time.perf_counter()
            outs[name], st = run(ids)
            sync()
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(outs[name])
            if st is not None:
                stats[name].append(st)
        for name in configs:
            differs = first_difference(outs[name], outs["plain"])
            same[name] += differs is None
            if differs is not None:
                parted[name].append(differs)
    tps = {name: tokens[name] / seconds[name] for name in configs}
    print(f"== decoding speed ({target.label}, {target.dtype}, {target.device}, kernel {target.kernel}, cache {cache}, "
          f"greedy, {n} new tokens, "
          f"{len(prompts)} prompts from {args.prompts})")
    print(f"   machine: {machine_name(target.device)} ({platform.machine()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; configurations interleaved per prompt")
    print(f"   {'configuration':34s} {'tok/s':>7s} {'vs HF':>6s} {'vs PLD':>6s} {'MAL':>5s} "
          f"{'target':>6s} {'draft':>6s} {'other':>6s} {'=plain':>6s}")
    rows = []
    for name in configs:
        row = {"config": name, "tokens_per_s": tps[name], "vs_hf_generate": tps[name] / tps["hf_generate"],
               "vs_hf_prompt_lookup": tps[name] / tps["hf_prompt_lookup"], "identical_to_plain": same[name],
               "first_difference": sorted(parted[name])}
        text = f"   {name:34s} {tps[name]:7.2f} {row['vs_hf_generate']:6.2f} {row['vs_hf_prompt_lookup']:6.2f}"
        if stats[name]:
            merged = GenerationStats.merge(stats[name])
            split = merged.time_split()
            row.update(mal=merged.mean_acceptance_length, split=split,
                       shapes=sorted({s.shape or "none" for s in merged.steps}))
            text += (f" {merged.mean_acceptance_length:5.2f} {split['target']:6.0%} {split['draft']:6.0%} "
                     f"{split['other']:6.0%}")
        else:
            text += f" {'':5s} {'':6s} {'':6s} {'':6s}"
        parts = f" (first differs at token {', '.join(map(str, sorted(parted[name])))})" if parted[name] else ""
        print(text + f" {same[name]:>3d}/{len(prompts)}{parts}")
        rows.append(row)
    records.emit("decode", {"bench": "decode", "model": target.label, "device": str(target.device), "kernel": target.kernel,
                      "cache": cache,
                      "dtype": str(target.dtype), "machine": machine_name(target.device), "prompts": args.prompts,
                      "num_prompts": len(prompts), "new_tokens": n, "threads": torch.get_num_threads(),
                      "configs": rows}, device=str(target.device))


if __name__ == "__main__":
    sys.exit(main())
