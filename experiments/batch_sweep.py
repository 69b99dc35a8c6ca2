"""The batch sweep behind scripts/bench_batch.py: tokens/s per drafter x shape x context x batch, paired with plain.

Owns `rows_at`, `sized` (`kv=POLICY@F` sized to the context), `sweep` and `crossovers`. Knows nothing about argument
parsing, tuning or records.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import specdec
from specdec.drafters import build

SUITE = Path(__file__).resolve().parents[2] / "experiments" / "prompts" / "long.jsonl"


def rows_at(target: specdec.Target, context: int, batch: int) -> list[list[int]]:
    """`batch` rows of exactly `context` token ids from the long suite's texts joined into one stream
    (no chat template): row b starts 1,009 * b tokens in (modulo the room left), so rows differ."""
    texts = [json.loads(line)["turns"][0] for line in SUITE.read_text().splitlines() if line.strip()]
    stream = [t for text in texts for t in target.tokenizer.encode(text)]
    room = len(stream) - context
    if room < 0:
        raise SystemExit(f"error: the long suite has {len(stream)} tokens, a row needs {context}")
    return [stream[(1009 * b) % (room + 1):][:context] for b in range(batch)]


def sized(spec: str, options: dict, context: int) -> tuple[str, dict]:
    """A drafter spec with `kv=POLICY@F` sized to the context (module docstring)."""
    kv = options.get("kv")
    if not isinstance(kv, str) or "@" not in kv:
        return spec, options
    policy, fraction = kv.split("@")
    keep = max(8, round(float(fraction) * context))
    concrete = {"window": f"window(sink=4,recent={keep - 4})", "snapkv": f"snapkv(budget={keep},window=16)"}
    if policy not in concrete:
        raise SystemExit(f"error: kv={kv!r}: only window@F and snapkv@F are sized by fraction")
    return spec, {**options, "kv": concrete[policy]}


def label(name: str, options: dict) -> str:
    return name if not options else f"{name}[{','.join(f'{k}={v}' for k, v in options.items())}]"


def run_cell(target, drafter, shape: str, rows: list[list[int]], tokens: int, cache: str) -> dict:
    out = specdec.generate_batch(target, drafter, rows, shape=shape, max_new_tokens=tokens, chat=False,
                                 stop_on_eos=False, cache=cache)
    s = out.stats
    return {"tok_s": s.decode_tokens_per_s, "mal": statistics.fmean(s.row_mal), "split": s.time_split(),
            "prefill_s": s.prefill_time_s}


def sweep(target, specs: list[tuple[str, dict]], contexts: list[int], batches: list[int], shapes: list[str],
          tokens: int, repeats: int, cache: str, log=print) -> tuple[list[dict], dict[str, str]]:
    """(cells, skipped drafters with why): every drafter x shape with plain decoding in the same
    rotation, per context and batch (see the module docstring); one line per cell to `log`."""
    skipped: dict[str, str] = {}
    cells = []
    for context in contexts:
        drafters = {}
        for name, options in specs:
            name, options = sized(name, options, context)
            drafter = build(name, target=target, **options)
            if not getattr(drafter, "batchable", False):
                skipped[label(name, options)] = "not batchable"
                continue
            drafters[label(name, options)] = drafter
        for batch in batches:
            rows = rows_at(target, context, batch)
            configs = [("none", None, "chain(1)")] + [(k, d, s) for k, d in drafters.items() for s in shapes]
            results: dict[tuple[str, str], list[dict]] = {(k, s): [] for k, _, s in configs}
            for rep in range(repeats):
                shift = rep % len(configs)
                for key, drafter, shape in configs[shift:] + configs[:shift]:
                    results[(key, shape)].append(run_cell(target, drafter, shape, rows, tokens, cache))
            plain = results[("none", "chain(1)")]
            for (key, shape), runs in results.items():
                ratios = [r["tok_s"] / p["tok_s"] for r, p in zip(runs, plain)]
                cell = {"drafter": key, "shape": shape if key != "none" else "-", "context": context, "batch": batch,
                        "tok_s": statistics.median(r["tok_s"] for r in runs), "speedup": statistics.median(ratios),
                        "speedup_range": [min(ratios), max(ratios)], "mal": statistics.fmean(r["mal"] for r in runs),
                        "split": runs[-1]["split"]}
                cells.append(cell)
                split = " / ".join(f"{cell['split'][k]:.0%}" for k in ("target", "draft", "other"))
                log(f"  ctx {context:5d} batch {batch:3d}  {key:38s} {cell['shape']:10s} {cell['tok_s']:8.1f} tok/s  "
                    f"x{cell['speedup']:.2f} [{min(ratios):.2f}, {max(ratios):.2f}]  MAL {cell['mal']:.2f}  "
                    f"split {split}")
    return cells, skipped


def crossovers(cells: list[dict]) -> dict:
    """(a) where speculation stops paying as the batch grows; (b) where lossy-KV self-drafting pays."""
    stop: dict[str, str | int] = {}
    for key in sorted({(c["drafter"], c["shape"], c["context"]) for c in cells if c["drafter"] != "none"}):
        curve = sorted((c["batch"], c["speedup"]) for c in cells if (c["drafter"], c["shape"], c["context"]) == key)
        paid = [b for b, x in curve if x >= 1.0]
        after = [b for b, x in curve if x < 1.0 and paid and b > min(paid)]
        name = f"{key[0]} {key[1]} @{key[2]}"
        stop[name] = after[0] if after else ("pays at every batch" if len(paid) == len(curve) else
                                             "never pays" if not paid else "pays only at larger batches")
    lossy: dict[str, dict] = {}
    full = {(c["shape"], c["context"], c["batch"]): c["tok_s"] for c in cells if c["drafter"] == "self_draft[kv=full]"}
    for c in cells:
        if not c["drafter"].startswith("self_draft") or c["drafter"] == "self_draft[kv=full]":
            continue
        entry = lossy.setdefault(f"{c['drafter']} {c['shape']}", {"beats_plain": [], "beats_full_kv": []})
        if c["speedup"] > 1.0:
            entry["beats_plain"].append([c["context"], c["batch"]])
        reference = full.get((c["shape"], c["context"], c["batch"]))
        if reference and c["tok_s"] > reference:
            entry["beats_full_kv"].append([c["context"], c["batch"]])
    for entry in lossy.values():
        for k in entry:
            entry[k].sort(key=lambda cb: (cb[0] * cb[1], cb[1]))
        entry["first_pays"] = entry["beats_plain"][0] if entry["beats_plain"] else None
    return {"speculation_stops_paying_at_batch": stop, "lossy_kv": lossy}
