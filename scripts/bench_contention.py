"""How much does load on the other core move the int4 fight? The main grid's int4 cell (its first block: eagle chain(4)
on torchao_int4, the paired 2x2 of experiments/cell.py, teacher forcing off) run once quiet and once beside each busy
loop pinned to the other core, its interaction regressed on the cell's fp32 plain tokens/s (issue 51 item 8).

    flock /tmp/specdec-timing.lock python scripts/bench_contention.py --cores 1,0 \\
        --markdown docs/measurements/contention-GenuineIntel-f6-m167.md
    python scripts/bench_contention.py --cores 0,0 model=tiny dataset=smoke max_new_tokens=8   # Hydra overrides

The timing side pins itself to the first core of --cores (one torch thread); each load is a Python subprocess pinned
to the second, started before the run's warm-up and ended after its last prompt. The slope is within prompts (each
prompt's three points less their means: a prompt's length moves its tokens/s, load should move the rest), with a
bootstrap CI over prompts. Prints a card, then one JSON line; --markdown also writes it as a generated page.
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

import numpy as np
import pandas as pd

LOADS = {"quiet": None,
         "compute": "import torch\ntorch.set_num_threads(1)\nx = torch.randn(256, 256)\n"
                    "while True:\n    x = torch.tanh(x @ x)",  # AVX-512 matmuls in the core's own L2
         "memory": "import torch\ntorch.set_num_threads(1)\na, b = torch.ones(2 ** 27), torch.empty(2 ** 27)\n"
                   "while True:\n    b.copy_(a)"}  # 512 MiB copied again and again: the shared L3 and DRAM
"""Each run's load on the other core: Python run in a subprocess (None: nothing runs there)."""


@contextlib.contextmanager
def busy(code: str | None, core: int) -> Iterator[subprocess.Popen | None]:
    """`code` running in a subprocess pinned to `core` for the length of the block (None: nothing)."""
    if code is None:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\n{code}"])
    try:
        time.sleep(1.0)  # past its imports: the run's warm-up starts beside the loop itself
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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


def measure(overrides: list[str], loads: list[str], core: int, n_boot: int) -> dict:
    """The cell once per load in `loads` (the load's loop on `core`): {load: {rows, wall_s}}."""
    from experiments.cell import run_cell
    from experiments.main import check_cells, grid_blocks
    from experiments.questions import load_questions
    from experiments.run import REFERENCE_QUANT, build_cached_drafter, load_cached_target
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.config import CONF_DIR

    block = grid_blocks(["quant=torchao_int4", "runner.teacher_forcing=false", *overrides])[0][0]
    check_cells([block])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        exp = OmegaConf.to_object(compose("config", overrides=block))
    target, reference = load_cached_target(exp), load_cached_target(exp, REFERENCE_QUANT)
    drafters = build_cached_drafter(exp, target), build_cached_drafter(exp, reference, REFERENCE_QUANT)
    questions = load_questions(exp.dataset)
    out = {"cell": [o for o in block if not o.startswith("results.")]}
    for name in loads:
        with busy(LOADS[name], core):
            started = time.perf_counter()
            rows = run_cell(target, drafters[0], questions, shape=str(exp.shape.spec), sampling=exp.sampling,
                            max_new_tokens=exp.max_new_tokens, reference=reference, reference_drafter=drafters[1],
                            warmup_tokens=exp.runner.warmup_tokens)
            out[name] = {"rows": pd.DataFrame(rows), "wall_s": time.perf_counter() - started}
    return out


def summarize(runs: dict, n_boot: int) -> dict:
    """Per run its fp32 plain tok/s (median over prompts) and interaction [CI]; the within-prompt slope of the
    interaction on fp32 plain tok/s over every run's prompts, and that slope times 10% of the quiet run's speed."""
    from experiments.verdict import factor_logs, interaction, per_question

    rng, points, out = np.random.default_rng(0), [], {"runs": {}}
    for name, run in runs.items():
        rows = run["rows"]
        v = interaction(rows, n_boot, rng)
        fp32 = per_question(rows).reference
        points.append(pd.DataFrame({"question_id": fp32.index, "x": fp32.to_numpy(),
                                    "y": np.exp(factor_logs(rows).interaction.reindex(fp32.index).to_numpy())}))
        out["runs"][name] = {"fp32_plain_tok_s": round(float(fp32.median()), 2), "wall_s": round(run["wall_s"], 1),
                             "interaction": [round(x, 4) for x in (v.point, v.lo, v.hi)], "verdict": v.label}
    slope = within_slope(pd.concat(points, ignore_index=True), n_boot, rng)
    tenth = 0.1 * out["runs"][next(iter(runs))]["fp32_plain_tok_s"]
    return out | {"prompts": len(points[0]), "slope_per_tok_s": [round(s, 5) for s in slope],
                  "per_10pct_slower_fp32": [round(-s * tenth, 4) for s in (slope[0], slope[2], slope[1])]}


def card(summary: dict) -> list[str]:
    """The human lines: a row per run, the slope, and how much load moved the interaction."""
    runs = summary["runs"]
    lines = [f"{name:8s} fp32 plain {r['fp32_plain_tok_s']:6.2f} tok/s  interaction {r['interaction'][0]:.3f} "
             f"[{r['interaction'][1]:.3f}, {r['interaction'][2]:.3f}] ({r['verdict']}, {r['wall_s']:.0f} s)"
             for name, r in runs.items()]
    s, d = summary["slope_per_tok_s"], summary["per_10pct_slower_fp32"]
    names = list(runs)
    lines.append(f"slope within prompts: {s[0]:+.4f} [{s[1]:+.4f}, {s[2]:+.4f}] interaction per fp32 tok/s over "
                 f"{summary['prompts']} prompts x {len(runs)} runs")
    lines.append(f"load moved fp32 plain from {runs[names[0]]['fp32_plain_tok_s']:.1f} tok/s ({names[0]}) to "
                 + " / ".join(f"{runs[n]['fp32_plain_tok_s']:.1f} ({n})" for n in names[1:])
                 + f" and the interaction from {runs[names[0]]['interaction'][0]:.2f} to "
                 + " / ".join(f"{runs[n]['interaction'][0]:.2f}" for n in names[1:])
                 + f"; 10% slower fp32 moves it by {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the cell (default: the main grid's)")
    parser.add_argument("--cores", default="1,0", help="TIMING,LOAD: the core the cell runs on, the loads' core")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"runs in order, of {', '.join(LOADS)}")
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--markdown", default="", help="also write the card as a generated page here")
    args = parser.parse_args(argv)
    timing, load = (int(c) for c in args.cores.split(","))
    loads = args.loads.split(",")
    if any(name not in LOADS for name in loads):
        parser.error(f"--loads {args.loads}: each of {', '.join(LOADS)}")
    os.sched_setaffinity(0, {timing})
    started = time.perf_counter()
    runs = measure(args.overrides, loads, load, args.bootstrap)
    summary = {"cell": " ".join(runs.pop("cell")), "cores": args.cores, **summarize(runs, args.bootstrap)}
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    lines = card(summary)
    print("\n".join(lines))
    if args.markdown:
        from specdec.machine import machine_facts, machine_key

        m, command = machine_facts("cpu"), "python scripts/bench_contention.py " + shlex.join(argv or sys.argv[1:])
        with open(args.markdown, "w", encoding="utf-8") as page:
            page.write("\n".join([
                f"<!-- generated by `{command}`; do not edit by hand -->", "",
                f"# Contention: the int4 cell's interaction under load on {m['name']} ({machine_key('cpu')})", "",
                f"`lscpu` model name \"{m['name']}\", {m.get('vendor')} family {m.get('family')} model "
                f"{m.get('model')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {summary['wall_s']:.0f} s "
                f"in all; command: `{command}`.", "", f"Cell: `{summary['cell']}`, timing on core {timing}, each load "
                f"on core {load} (`LOADS` in scripts/bench_contention.py: a compute spin, a memory stream). The slope "
                "is within prompts, its CI a bootstrap over prompts.", "", "```", *lines, "```", ""]))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
