"""Batches: where speculation stops paying as the batch grows, and where lossy-KV self-drafting starts.

For each context length and batch size, every drafter x shape runs `specdec.generate_batch` on the
same B rows (long-suite text cut to the context, each row its own slice of it), with plain decoding
(drafter none) in the same rotation, `--repeats` times in rotating order so drift hits all alike.
Every row decodes exactly `--tokens` tokens (EOS does not stop it). Per configuration it prints the
total decode tokens/s (all rows, prefill excluded), the speedup over plain at the same batch and
context (median of the per-repeat paired ratios, with their range), each row's MAL averaged, and
the step-time split (target forward / draft / other). Then the crossovers:

- (a) per drafter x shape x context: the smallest batch at which the speedup falls below 1 (having
  been >= 1 at a smaller batch), or "pays at every batch" / "never pays";
- (b) per lossy KV policy of `self_draft`: the (context, batch) cells where it beats plain decoding,
  and where it beats `self_draft` with the full cache (the cells where compression pays), by
  ascending batch x context.

One JSON line closes the run, recorded through `specdec.measure.records` (kind `batch`). Not a test:
a measurement; run it on quiet cores with one thread.

    python scripts/bench_batch.py [--model smollm2-135m] [--batches 1,2,4,8,16,32] [--contexts 256,2048]
        [--drafters "none,ngram,eagle,self_draft[kv=full],self_draft[kv=window@0.05],..."]
        [--shapes "chain(4);auto"] [--tokens 32] [--repeats 2] [--threads 1] [--cache static]

In `--drafters`, `kv=POLICY@F` sizes a policy to keep a fraction F of the context: `window@F` ->
`window(sink=4,recent=F*C-4)`, `snapkv@F` -> `snapkv(budget=F*C,window=16)`; other specs pass as is
(`kv=quant(bits=4)`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import specdec
from specdec.drafters import build
from specdec.drafters.registry import parse_specs
from specdec.machine import machine_name
from specdec.measure import records
from specdec.tune import ensure_tuned

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "experiments" / "prompts" / "long.jsonl"
DEFAULT_DRAFTERS = ("none,ngram,eagle,self_draft[kv=full],self_draft[kv=window@0.05],"
                    "self_draft[kv=snapkv@0.05],self_draft[kv=quant(bits=4)]")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--drafters", default=DEFAULT_DRAFTERS)
    parser.add_argument("--shapes", default="chain(4);auto")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", default="static", help="the loop's cache kind (static: no copy per step)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    shapes = [s.strip() for s in args.shapes.split(";") if s.strip()]
    ensure_tuned(args.model, args.threads, drafters=())
    target = specdec.load_target(args.model, threads=args.threads)
    specs = [(n, o) for n, o in parse_specs(args.drafters) if n != "none"]
    skipped: dict[str, str] = {}
    cells = []
    print(f"== bench_batch: {target.label} on {machine_name(target.device)}, {args.threads} thread(s), "
          f"cache={args.cache}, {args.tokens} tokens per row")
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
            for rep in range(args.repeats):
                shift = rep % len(configs)
                for key, drafter, shape in configs[shift:] + configs[:shift]:
                    results[(key, shape)].append(run_cell(target, drafter, shape, rows, args.tokens, args.cache))
            plain = results[("none", "chain(1)")]
            for (key, shape), runs in results.items():
                ratios = [r["tok_s"] / p["tok_s"] for r, p in zip(runs, plain)]
                cell = {"drafter": key, "shape": shape if key != "none" else "-", "context": context, "batch": batch,
                        "tok_s": statistics.median(r["tok_s"] for r in runs), "speedup": statistics.median(ratios),
                        "speedup_range": [min(ratios), max(ratios)], "mal": statistics.fmean(r["mal"] for r in runs),
                        "split": runs[-1]["split"]}
                cells.append(cell)
                split = " / ".join(f"{cell['split'][k]:.0%}" for k in ("target", "draft", "other"))
                print(f"  ctx {context:5d} batch {batch:3d}  {key:38s} {cell['shape']:10s} {cell['tok_s']:8.1f} tok/s  "
                      f"x{cell['speedup']:.2f} [{min(ratios):.2f}, {max(ratios):.2f}]  MAL {cell['mal']:.2f}  "
                      f"split {split}", flush=True)
    plain_curve = {c["batch"]: c["tok_s"] for c in cells if c["drafter"] == "none" and c["context"] == contexts[0]}
    result = {"bench": "batch", "model": target.label, "machine": machine_name(target.device), "threads": args.threads,
              "cache": args.cache, "tokens": args.tokens, "repeats": args.repeats, "contexts": contexts,
              "batches": batches, "plain_tok_s_vs_batch": plain_curve,
              "plain_batch8_over_batch1": (plain_curve[8] / plain_curve[1]) if {1, 8} <= set(plain_curve) else None,
              "crossovers": crossovers(cells), "skipped": skipped, "cells": cells}
    print(json.dumps(result["crossovers"], indent=1))
    records.emit("batch", result, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
