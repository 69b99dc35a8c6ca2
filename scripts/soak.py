"""Soak: decode mixed batches for a while and watch the process's resident memory.

Round after round, every registered drafter (built once, reused) decodes a batch of 1-4 random
token-id prompts of 1-32 tokens (one prompt for a drafter that is not batchable), 1-16 new tokens a
row, in a shape of `SHAPES` and at T = 0 or 0.7 in turn, on a tiny fp32 llama (or the embedded
model with --embedded). The resident set (/proc/self/statm) is sampled every --every seconds. The
first 10% of the time is warm-up; growth is the last sample over the first one after warm-up.
Prints a short card, then one JSON line: samples, rss_warm_mb, rss_end_mb, growth_pct, passed
(growth <= 5%). A check, not a measurement: nothing is recorded.

    python scripts/soak.py [--minutes 30] [--every 10] [--embedded] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

import specdec
from specdec.drafters import names
from specdec.drafters.registry import build_for_tests

SHAPES = ["chain(4)", "tree(2,2,1)", "dynamic(top_k=3,depth=4,budget=10)", "auto"]
MAX_GROWTH_PCT = 5.0


def rss_mb() -> float:
    """This process's resident set, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(target, seconds: float, every: float, rng: random.Random) -> tuple[list[tuple[float, float]], int]:
    """Decode rounds for `seconds`; ([(elapsed s, RSS MiB)] sampled every `every` s, batches decoded)."""
    drafters = [build_for_tests(name, target=target) for name in names()]
    samples, batches, start = [(0.0, rss_mb())], 0, time.monotonic()
    while (now := time.monotonic() - start) < seconds:
        drafter = drafters[batches % len(drafters)]
        rows = rng.randint(1, 4) if getattr(drafter, "batchable", False) else 1
        prompts = [[rng.randrange(target.vocab_size) for _ in range(rng.randint(1, 32))] for _ in range(rows)]
        specdec.generate_batch(target, drafter, prompts, shape=rng.choice(SHAPES), chat=False, seed=batches,
                               max_new_tokens=[rng.randint(1, 16) for _ in prompts], temperature=0.7 * (batches % 2))
        batches += 1
        if now >= samples[-1][0] + every:
            samples.append((now, rss_mb()))
    return samples + [(time.monotonic() - start, rss_mb())], batches


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--embedded", action="store_true", help="the embedded model instead of a tiny llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target = specdec.load_target() if args.embedded else specdec.tiny_target("llama", vocab_size=256, seed=0)
    seconds = args.minutes * 60
    samples, batches = soak(target, seconds, args.every, random.Random(args.seed))
    warm, end = next(rss for t, rss in samples if t >= 0.1 * seconds), samples[-1][1]
    growth = 100 * (end - warm) / warm
    result = {"target": target.label, "minutes": args.minutes, "batches": batches, "samples": len(samples),
              "rss_start_mb": round(samples[0][1], 1), "rss_warm_mb": round(warm, 1), "rss_end_mb": round(end, 1),
              "rss_max_mb": round(max(rss for _, rss in samples), 1), "growth_pct": round(growth, 2),
              "max_growth_pct": MAX_GROWTH_PCT, "passed": growth <= MAX_GROWTH_PCT}
    print(f"soak: {target.label}, {args.minutes:g} min, {batches} batches, {len(samples)} RSS samples\n"
          f"  RSS MiB: start {samples[0][1]:.1f}, after warm-up {warm:.1f}, end {end:.1f}, max {result['rss_max_mb']}\n"
          f"  growth {growth:+.2f}% (limit {MAX_GROWTH_PCT:g}%): {'PASS' if result['passed'] else 'FAIL'}")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
