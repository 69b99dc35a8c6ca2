"""Latency curve of a target under transformers' `sdpa` and specdec's `specdec_sdpa`, interleaved.

    python scripts/bench_attention.py [--caches dynamic,static] [--widths 1,5,9] [--target tiny-llama --contexts 8]

Per cache and context: milliseconds per attention and width, their ratio, a same-logits check, one JSON line.
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

import specdec
from specdec.measure import records
from specdec.measure.latency import CurveTimer
from specdec.runtime.attention import NAME
from specdec.runtime.cache import KVCache
from specdec.machine import machine_name

ATTENTIONS = ("sdpa", NAME)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def curves(target: specdec.Target, widths: tuple[int, ...], context: int, repeats: int,
           cache: str) -> dict[str, list[float]]:
    """Median forward seconds per attention and width: one `CurveTimer` per attention (a width is a tree
    block of w children of the prefix, as `measure_latency` times it), their passes interleaved."""
    timers = {}
    for name in ATTENTIONS:
        target.model.set_attn_implementation(name)
        timers[name] = CurveTimer(target, widths, (context,), cache=cache)
    for _ in range(repeats):
        for name, timer in timers.items():
            target.model.set_attn_implementation(name)
            timer.sample()
    return {name: list(timer.curve().seconds[0]) for name, timer in timers.items()}


def same_logits(target: specdec.Target, width: int) -> bool:
    """Whether both attentions give bit-identical logits for one `width`-node tree after 64 tokens."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (64,), generator=gen).tolist()
    tokens = torch.randint(0, target.vocab_size, (1, width), generator=gen)
    parents = torch.tensor([-1] + [i // 2 for i in range(width - 1)])  # a binary tree
    logits = []
    for name in ATTENTIONS:
        target.model.set_attn_implementation(name)
        cache = KVCache()
        target.prefill(prefix, cache)
        logits.append(target.forward(tokens, cache, parents).logits)
    return torch.equal(*logits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="a specdec.load_target name or path")
    parser.add_argument("--dtype", default=None, help="weights dtype (default: the target's own)")
    parser.add_argument("--widths", type=_ints, default=(1, 2, 5, 9, 17, 33))
    parser.add_argument("--contexts", type=_ints, default=(256, 1024))
    parser.add_argument("--caches", default="dynamic", help="comma-separated cache kinds (specdec.runtime.forwards.CACHES)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    target = specdec.load_target(args.target, dtype=args.dtype, threads=args.threads)
    results = []
    for cache in (c for c in args.caches.split(",") if c):
        for context in args.contexts:
            seconds = curves(target, args.widths, context, args.repeats, cache)
            print(f"== {target.label} ({target.dtype}, kernel {target.kernel}), cache {cache}, {context} cached "
                  f"tokens, {machine_name(target.device)}, {torch.get_num_threads()} thread(s)")
            print("   attention     " + " ".join(f"{'@' + str(w):>8s}" for w in args.widths))
            for name, row in seconds.items():
                print(f"   {name:13s} " + " ".join(f"{t * 1e3:6.1f}ms" for t in row))
            print(f"   {'ratio':13s} " + " ".join(f"{b / a:7.3f}x" for a, b in zip(*seconds.values())))
            results.append({"cache": cache, "context": context, "seconds": seconds})
    identical = same_logits(target, max(args.widths))
    print(f"same logits on a {max(args.widths)}-node tree: {identical}")
    records.emit("attention", {"bench": "attention", "target": args.target, "dtype": str(target.dtype),
                      "kernel": target.kernel, "machine": machine_name(target.device), "arch": platform.machine(),
                      "threads": torch.get_num_threads(), "torch": torch.__version__, "widths": list(args.widths),
                      "repeats": args.repeats, "same_logits": identical, "results": results}, device=str(target.device))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
