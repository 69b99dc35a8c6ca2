"""Decode speed of two git revisions side by side: plain and a drafted shape, interleaved in rotating order.

    python scripts/bench_versions.py 174ff2e HEAD --rounds 6 --prompts 4   # on a quiet core: taskset -c 1

Each revision is checked out once into a temporary worktree and run in a fresh one-thread interpreter per round and
config; prints the ratio new / old per config with a 95% interval over rounds, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {"plain": "None", "eagle chain(4)": "specdec.drafters.build('eagle', target=t)"}
CHILD = """import sys, time, torch; sys.path.insert(0, {root!r}); torch.set_num_threads(1); import specdec
t = specdec.load_target('smollm2-135m'); d = {drafter}; prompts = {prompts!r}
specdec.generate(t, d, prompts[0], shape='chain(4)', max_new_tokens=8, stop_on_eos=False)
start, n = time.perf_counter(), 0
for p in prompts: n += len(specdec.generate(t, d, p, shape='chain(4)', max_new_tokens=64, stop_on_eos=False).token_ids)
print(n / (time.perf_counter() - start))"""
PROMPTS = ["Why is the sky blue?", "Write a haiku about rain.", "List three uses of a paperclip.",
           "How do bicycles stay upright?", "Explain recursion to a child.", "Name the planets in order."]


def tok_s(root: Path, config: str, prompts: list[str]) -> float:
    code = CHILD.format(root=str(root), drafter=CONFIGS[config], prompts=prompts)
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old"), parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        roots = {rev: Path(tmp) / rev for rev in (args.old, args.new)}
        for rev, root in roots.items():
            subprocess.run(["git", "worktree", "add", "--detach", str(root), rev], check=True, capture_output=True)
        runs = [(rev, c) for c in CONFIGS for rev in roots]
        seen: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        for r in range(args.rounds):
            for rev, config in runs[r % len(runs):] + runs[: r % len(runs)]:
                seen[rev, config].append(tok_s(roots[rev], config, PROMPTS[: args.prompts]))
        for root in roots.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(root)], check=True)
    out = {}
    for config in CONFIGS:
        ratios = [n / o for o, n in zip(seen[args.old, config], seen[args.new, config])]
        half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5
        out[config] = {"old_tok_s": statistics.median(seen[args.old, config]), "ratio": statistics.mean(ratios),
                       "ci": [statistics.mean(ratios) - half, statistics.mean(ratios) + half], "rounds": len(ratios)}
        print(f"| {config} | {out[config]['old_tok_s']:.1f} tok/s | {out[config]['ratio']:.3f} "
              f"[{out[config]['ci'][0]:.3f}, {out[config]['ci'][1]:.3f}] |")
    print(json.dumps({"old": args.old, "new": args.new, "prompts": args.prompts, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
