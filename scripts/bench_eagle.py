"""Benchmark the shipped EAGLE head: MAL and tokens/s vs the plain loop, per draft shape and vocabulary.

    python scripts/bench_eagle.py                                  # the real run (quiet machine!)
    python scripts/bench_eagle.py --prompts 1 --max-new-tokens 16  # a smoke run

Prompts: the first turn of each question in experiments/prompts/default.jsonl (the evaluation
suite; chat template applied); if that file is missing, a small built-in list, and the card says so.
Greedy (T = 0). For every prompt the plain loop (`specdec.generate(target, None, ...)`) and every
EAGLE configuration run back to back, so load drift hits all of them alike. Prints a human card,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import specdec

SUITE = Path(__file__).resolve().parents[1] / "experiments" / "prompts" / "default.jsonl"
BUILTIN = [
    "What are the main causes of ocean tides?",
    "Write a Python function that checks whether a string is a valid IPv4 address.",
    "Give a short summary of how a bill becomes law in the United States.",
    "Tell me a short story about a lighthouse keeper.",
]
SHAPES = ["chain(4)", "tree(4,2,1,1)", "dynamic(top_k=8,depth=6,budget=32)"]


def load_prompts(limit: int) -> tuple[list[str], str]:
    if SUITE.exists():
        rows = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]
        return [row["turns"][0] for row in rows][:limit], str(SUITE)
    return BUILTIN[:limit], f"built-in list ({SUITE} not found)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--head", default=None, help="head .safetensors (default: the shipped one)")
    parser.add_argument("--prompts", type=int, default=1000, help="at most this many prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-vocab", type=int, default=4096, help="size of the reduced draft vocabulary")
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = specdec.load_target(args.target)
    prompts, source = load_prompts(args.prompts)
    methods: dict[str, tuple[object, str]] = {"plain": (None, "chain(1)")}
    for vocab in (None, args.draft_vocab):
        drafter = specdec.drafters.build("eagle", target=target, head=args.head, draft_vocab=vocab)
        for shape in args.shapes:
            methods[f"eagle {shape} vocab={vocab or target.vocab_size}"] = (drafter, shape)

    specdec.generate(target, None, prompts[0], max_new_tokens=4)  # warm-up
    stats: dict[str, list[specdec.GenerationStats]] = {name: [] for name in methods}
    started = time.perf_counter()
    for prompt in prompts:
        plain_tokens = None
        for name, (drafter, shape) in methods.items():
            out = specdec.generate(target, drafter, prompt, shape=shape, max_new_tokens=args.max_new_tokens)
            if plain_tokens is None:
                plain_tokens = out.token_ids
            elif out.token_ids != plain_tokens:
                raise AssertionError(f"{name} diverged from the plain greedy output on {prompt[:60]!r}")
            stats[name].append(out.stats)
    merged = {name: specdec.GenerationStats.merge(s) for name, s in stats.items()}
    plain_speed = merged["plain"].decode_tokens_per_s

    print(f"EAGLE bench: target {target.name}, {len(prompts)} prompts from {source}, T = 0, "
          f"max_new_tokens = {args.max_new_tokens}, torch threads = {torch.get_num_threads()}, "
          f"{time.perf_counter() - started:.0f} s")
    print(f"{'method':52s} {'MAL':>5s} {'drafted':>7s} {'tok/s':>7s} {'vs plain':>8s} "
          f"{'draft ms':>8s} {'verify ms':>9s}")
    rows = {}
    for name, s in merged.items():
        steps = max(1, s.num_steps)
        row = {**s.summary(), "speedup_vs_plain": s.decode_tokens_per_s / plain_speed if plain_speed else 0.0,
               "draft_ms_per_step": 1e3 * s.draft_time_s / steps, "verify_ms_per_step": 1e3 * s.verify_time_s / steps}
        rows[name] = row
        print(f"{name:52s} {row['mean_acceptance_length']:5.2f} {row['mean_drafted']:7.1f} "
              f"{row['decode_tokens_per_s']:7.1f} {row['speedup_vs_plain']:7.2f}x "
              f"{row['draft_ms_per_step']:8.1f} {row['verify_ms_per_step']:9.1f}")
    print("MAL = mean acceptance length (bonus/recovered token included); tok/s = decode tokens/s (prefill excluded).")
    print(json.dumps({"bench": "eagle", "target": target.name, "prompts": len(prompts), "source": source,
                      "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                      "machine": platform.processor() or platform.machine(), "results": rows}))


if __name__ == "__main__":
    main()
