"""Benchmark EAGLE heads: MAL and tokens/s vs the plain loop per head, shape and vocabulary (at T = 0 every one must
reproduce the plain greedy output). Prints a card, then one JSON line.

    python scripts/bench_eagle.py [--suite FILE] [--heads old=shipped new=PATH] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import specdec
from experiments.questions import read_jsonl
from specdec.measure import records
from specdec.machine import machine_name
from specdec.tune import ensure_tuned

SUITE = Path(__file__).resolve().parents[1] / "experiments" / "prompts" / "default.jsonl"
SHAPES = ["chain(4)", "tree(4,2,1,1)", "dynamic(top_k=8,depth=6,budget=32)"]


def load_prompts(suite: Path, limit: int, stride: int = 1) -> list[str]:
    """The first turn of every `stride`-th question of `suite` (experiments.questions' format), at most `limit`."""
    if stride < 1:
        raise ValueError(f"--stride must be >= 1, got {stride}")
    return [q.turns[0] for q in read_jsonl(suite)][::stride][:limit]


def parse_heads(items: list[str]) -> dict[str, str | None]:
    """['old=shipped', 'new=path'] -> {'old': None, 'new': 'path'} (None = the shipped head)."""
    heads = {}
    for item in items:
        label, _, path = item.partition("=")
        if not label or not path:
            raise ValueError(f"--heads entries read LABEL=PATH or LABEL=shipped, got {item!r}")
        heads[label] = None if path == "shipped" else path
    return heads


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--heads", nargs="+", default=["shipped=shipped"],
                        help="LABEL=PATH (a head .safetensors) or LABEL=shipped, compared side by side")
    parser.add_argument("--suite", type=Path, default=SUITE, help="prompt suite (.jsonl with 'turns')")
    parser.add_argument("--prompts", type=int, default=1000, help="at most this many prompts")
    parser.add_argument("--stride", type=int, default=1,
                        help="every STRIDE-th prompt of the suite (a subset that spans its categories)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--vocabs", nargs="+", default=["full", "4096"],
                        help="draft vocabularies: 'full' and/or sizes of the reduced one")
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the tuned count)")
    return parser


def measure(args, target, prompts: list[str]) -> dict[str, specdec.GenerationStats]:
    """Pooled stats per method (plain, then head x vocabulary x shape), prompt by prompt back to back;
    AssertionError where a greedy method's output differs from plain's."""
    methods: dict[str, tuple[object, str]] = {"plain": (None, "chain(1)")}
    for label, head in parse_heads(args.heads).items():
        for vocab in (None if v == "full" else int(v) for v in args.vocabs):
            drafter = specdec.drafters.build("eagle", target=target, head=head, draft_vocab=vocab)
            for shape in args.shapes:
                methods[f"{label} {shape} vocab={vocab or target.vocab_size}"] = (drafter, shape)

    specdec.generate(target, None, prompts[0], max_new_tokens=4)  # warm-up
    stats: dict[str, list[specdec.GenerationStats]] = {name: [] for name in methods}
    for i, prompt in enumerate(prompts):
        plain_tokens = None
        for name, (drafter, shape) in methods.items():
            out = specdec.generate(target, drafter, prompt, shape=shape, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, seed=i)
            if plain_tokens is None:
                plain_tokens = out.token_ids
            elif args.temperature == 0 and out.token_ids != plain_tokens:
                raise AssertionError(f"{name} diverged from the plain greedy output on {prompt[:60]!r}")
            stats[name].append(out.stats)
    return {name: specdec.GenerationStats.merge(s) for name, s in stats.items()}


def main() -> None:
    args = parser().parse_args()
    ensure_tuned(args.target, args.threads)
    target = specdec.load_target(args.target, threads=args.threads or "auto")
    prompts = load_prompts(args.suite, args.prompts, args.stride)
    machine = machine_name(target.device)
    started = time.perf_counter()
    merged = measure(args, target, prompts)
    plain_speed = merged["plain"].decode_tokens_per_s

    print(f"EAGLE bench: target {target.name}, {len(prompts)} prompts from {args.suite} (stride {args.stride}), "
          f"T = {args.temperature}, machine {machine}, "
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
    records.emit("eagle", {"bench": "eagle", "target": target.name, "prompts": len(prompts),
                      "source": str(args.suite), "stride": args.stride,
                      "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                      "threads": torch.get_num_threads(), "machine": machine, "results": rows}, device=str(target.device))


if __name__ == "__main__":
    main()
