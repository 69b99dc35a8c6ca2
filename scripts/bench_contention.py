"""How much does load on the other core move the int4 fight (issue 51 item 8)? The main grid's int4 cell (its first
block: eagle chain(4) on torchao_int4, the paired 2x2 of experiments/cell.py, no teacher forcing) runs quiet, then
beside each busy loop of `LOADS` pinned to the other core; its interaction is regressed on its fp32 plain tokens/s
within prompts (a prompt's length moves its tokens/s; load should move the rest), bootstrap CI over prompts. Prints
a card and one JSON line; --markdown also writes the card as a generated page.

    flock /tmp/specdec-timing.lock python scripts/bench_contention.py --cores 1,0 --markdown PAGE.md
    python scripts/bench_contention.py --cores 0,0 model=tiny dataset=smoke max_new_tokens=8   # Hydra overrides
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

LOADS = {"quiet": None,
         "compute": "import torch\ntorch.set_num_threads(1)\nx = torch.randn(256, 256)\n"
                    "while True:\n    x = torch.tanh(x @ x)",  # AVX-512 matmuls in the core's own L2
         "memory": "import torch\ntorch.set_num_threads(1)\na, b = torch.ones(2 ** 27), torch.empty(2 ** 27)\n"
                   "while True:\n    b.copy_(a)"}  # 512 MiB copied again and again: the shared L3 and DRAM
"""Each run's load on the other core: Python code for a subprocess (None: nothing runs there)."""
SIZE = ["quant=torchao_int4", "runner.teacher_forcing=false", "dataset.per_category=2"]
"""The cell's overrides of the main grid: its int4 kernel, and 14 of its 21 prompts (2 per category) x its 64 tokens, ~3
minutes a run quiet on the Intel f6 m167 (the main job's cell spent 196 s in its four runs over 21), ~10 in all."""


@contextlib.contextmanager
def busy(code: str | None, core: int) -> Iterator[subprocess.Popen | None]:
    """`code` running in a subprocess pinned to `core` for the length of the block (None: nothing)."""
    proc = code and subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\n{code}"])
    try:
        time.sleep(1.0 if proc else 0.0)  # past its imports: the run's warm-up starts beside the loop itself
        yield proc
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)


def core_busy(core: int) -> tuple[int, int]:
    """(busy, all) jiffies of `core` since boot, from /proc/stat (idle and iowait are not busy)."""
    ticks = [int(t) for t in next(line.split() for line in open("/proc/stat") if line.startswith(f"cpu{core} "))[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def within_slope(frame: pd.DataFrame, n_boot: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """Slope of `y` on `x` within prompts (columns question_id, x, y; each prompt's points less their means), with a
    95% percentile bootstrap interval over prompts (a drawn prompt brings all its points)."""
    centred = frame[["x", "y"]] - frame.groupby("question_id")[["x", "y"]].transform("mean")
    sums = (centred.x * centred.y).groupby(frame.question_id).sum(), (centred.x ** 2).groupby(frame.question_id).sum()
    xy, xx = (s.to_numpy(float) for s in sums)  # [Q]: each prompt's share of the slope's two sums
    draws = rng.integers(0, len(xy), size=(n_boot, len(xy)))  # [B, Q]
    boot = xy[draws].sum(1) / xx[draws].sum(1)
    lo, hi = np.percentile(boot, [2.5, 97.5]) if n_boot else (np.nan, np.nan)
    return float(xy.sum() / xx.sum()), float(lo), float(hi)


def measure(overrides: list[str], core: int) -> dict:
    """The cell once per load of `LOADS` (each loop on `core`): {"cell": its overrides, load: {rows, wall_s}}."""
    from experiments import cell, main as job, questions, run

    block = job.grid_blocks([*SIZE, *overrides])[0][0]
    exp = job.check_cells([block])[0]
    target, reference = run.load_cached_target(exp), run.load_cached_target(exp, run.REFERENCE_QUANT)
    drafters = run.build_cached_drafter(exp, target), run.build_cached_drafter(exp, reference, run.REFERENCE_QUANT)
    out = {"cell": " ".join(o for o in block if not o.startswith("results."))}
    for name, code in LOADS.items():
        with busy(code, core):
            started, before = time.perf_counter(), core_busy(core)
            rows = cell.run_cell(target, drafters[0], questions.load_questions(exp.dataset), shape=str(exp.shape.spec),
                            sampling=exp.sampling, max_new_tokens=exp.max_new_tokens, reference=reference,
                            reference_drafter=drafters[1], warmup_tokens=exp.runner.warmup_tokens)
            after = core_busy(core)  # how busy the load's core was, whatever else ran there
            out[name] = {"rows": pd.DataFrame(rows), "wall_s": time.perf_counter() - started,
                         "load_core_busy": (after[0] - before[0]) / max(1, after[1] - before[1])}
    return out


def summarize(runs: dict, n_boot: int) -> dict:
    """Per run its fp32 plain tok/s (median over prompts) and interaction [CI]; the within-prompt slope of the
    interaction on fp32 plain tok/s over every run's prompts, and that slope times 10% of the quiet run's speed."""
    from experiments.verdict import factor_logs, interaction, per_question

    rng, points, out = np.random.default_rng(0), [], {}
    for name, run in runs.items():
        v, fp32 = interaction(run["rows"], n_boot, rng), per_question(run["rows"]).reference
        points.append(pd.DataFrame({"question_id": fp32.index, "x": fp32.to_numpy(),
                                    "y": np.exp(factor_logs(run["rows"]).interaction.reindex(fp32.index).to_numpy())}))
        out[name] = {"fp32_plain_tok_s": round(float(fp32.median()), 2), "wall_s": round(run["wall_s"], 1),
                     "load_core_busy": round(run["load_core_busy"], 3),
                     "interaction": [round(x, 4) for x in (v.point, v.lo, v.hi)], "verdict": v.label}
    slope = within_slope(pd.concat(points, ignore_index=True), n_boot, rng)
    tenth = 0.1 * out["quiet"]["fp32_plain_tok_s"]
    return {"runs": out, "prompts": len(points[0]), "slope_per_tok_s": [round(s, 5) for s in slope],
            "per_10pct_slower_fp32": [round(-s * tenth, 4) for s in (slope[0], slope[2], slope[1])]}


def card(summary: dict) -> list[str]:
    """The human lines: a row per run, the slope, and how much load moved the interaction."""
    runs, (s, lo, hi), d = summary["runs"], summary["slope_per_tok_s"], summary["per_10pct_slower_fp32"]
    speeds, points = [r["fp32_plain_tok_s"] for r in runs.values()], [r["interaction"][0] for r in runs.values()]
    return [*(f"{name:8s} fp32 plain {r['fp32_plain_tok_s']:6.2f} tok/s  interaction {r['interaction'][0]:.3f} "
              f"[{r['interaction'][1]:.3f}, {r['interaction'][2]:.3f}] ({r['verdict']}, {r['wall_s']:.0f} s, load core "
              f"{r['load_core_busy']:.0%} busy)"
              for name, r in runs.items()),
            f"slope within prompts: {s:+.4f} [{lo:+.4f}, {hi:+.4f}] interaction per fp32 tok/s ({summary['prompts']} "
            f"prompts x {len(runs)} runs); load moved fp32 plain over {min(speeds):.1f}-{max(speeds):.1f} tok/s and "
            f"the interaction over {min(points):.2f}-{max(points):.2f}: 10% slower fp32 moves it {d[0]:+.3f} "
            f"[{d[1]:+.3f}, {d[2]:+.3f}]"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the cell (default: the main grid's)")
    parser.add_argument("--cores", default="1,0", help="TIMING,LOAD: the core the cell runs on (one torch thread), "
                        "the core each load's subprocess is pinned to")
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--markdown", default="", help="also write the card as a generated page here")
    args = parser.parse_args(argv)
    timing, load = (int(c) for c in args.cores.split(","))
    os.sched_setaffinity(0, {timing})
    started = time.perf_counter()
    runs = measure(args.overrides, load)
    summary = {"cell": runs.pop("cell"), "cores": args.cores, **summarize(runs, args.bootstrap),
               "wall_s": round(time.perf_counter() - started, 1)}
    lines = card(summary)
    print("\n".join(lines))
    if args.markdown:
        from specdec.machine import machine_facts, machine_key

        m, command = machine_facts("cpu"), "python scripts/bench_contention.py " + shlex.join(argv or sys.argv[1:])
        Path(args.markdown).write_text(
            f"<!-- generated by `{command}`; do not edit by hand -->\n\n# Contention: the int4 cell's interaction "
            f"under load on {m['name']} ({machine_key('cpu')})\n\n`lscpu` model name \"{m['name']}\", {m['vendor']} "
            f"family {m['family']} model {m['model']}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{summary['wall_s']:.0f} s in all; command: `{command}`.\n\nCell: `{summary['cell']}`, timed on core "
            f"{timing}, each load on core {load} (`LOADS` in scripts/bench_contention.py); the slope is within "
            "prompts, its CI a bootstrap over prompts.\n\n```\n" + "\n".join(lines) + "\n```\n", encoding="utf-8")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
