"""Batches: where speculation stops paying as the batch grows, and where lossy-KV self-drafting starts.

Per context x batch, every drafter x shape runs `generate_batch` on the same rows, plain in the same rotation,
`--repeats` times; prints tok/s, paired speedup, MAL and step-time split, then the crossovers (the smallest batch where
speedup < 1; the cells where a lossy KV policy beats plain and the full cache) and one JSON line (record kind `batch`).
In `--drafters`, `kv=window@F` -> `window(sink=4,recent=F*C-4)`, `snapkv@F` -> `snapkv(budget=F*C,window=16)`.

    python scripts/bench_batch.py [--batches 1,2,4,8] [--contexts 256,2048] [--drafters "none,ngram,..."]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import specdec
from specdec.drafters.registry import parse_specs
from specdec.machine import machine_name
from specdec.measure import records
from experiments.batch_sweep import crossovers, sweep
from specdec.tune import ensure_tuned

DEFAULT_DRAFTERS = ("none,ngram,eagle,self_draft[kv=full],self_draft[kv=window@0.05],"
                    "self_draft[kv=snapkv@0.05],self_draft[kv=quant(bits=4)]")


def parse(argv: list[str] | None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    shapes = [s.strip() for s in args.shapes.split(";") if s.strip()]
    ensure_tuned(args.model, args.threads, drafters=())
    target = specdec.load_target(args.model, threads=args.threads)
    specs = [(n, o) for n, o in parse_specs(args.drafters) if n != "none"]
    print(f"== bench_batch: {target.label} on {machine_name(target.device)}, {args.threads} thread(s), "
          f"cache={args.cache}, {args.tokens} tokens per row")
    cells, skipped = sweep(target, specs, contexts, batches, shapes, args.tokens, args.repeats, args.cache,
                           log=lambda line: print(line, flush=True))
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
