"""The main job: the default grid on the embedded target, then the leaderboard and its heatmaps.

    python -m experiments.main                       # grid from experiments/grids/main.yaml
    python -m experiments.main sampling.max_new_tokens=32 results.dir=results/quick
    python -m experiments.main --dry-run             # print the Hydra command only

Owns the default grid: every registered drafter except those grids/main.yaml excludes (`none`, the
baseline; read from the registry at start, so drafters added later join with no change here), the
shapes and quantization specs of grids/main.yaml, its fixed settings, and any overrides given on
the command line (which replace the grid's value for the same key). Runs it as one Hydra multirun
(`python -m experiments.run -m ...`, cells one at a time in one process), then prints the
leaderboard of the whole results store and, as its last line, one JSON object (cells stored, the
grid's exit status, the best entries by MAL and by speedup).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from experiments.leaderboard import ENTRY, write_leaderboard
from experiments.store import ResultsStore, StoreError

GRID_FILE = Path(__file__).parent / "grids" / "main.yaml"


def grid_overrides(extra: list[str], grid_file: Path = GRID_FILE) -> list[str]:
    """The multirun's overrides: drafters from the registry (less the excluded), the grid file's
    sweeps and fixed values, then `extra` (an extra `KEY=...` replaces the grid's entry for KEY)."""
    from specdec import drafters

    grid = OmegaConf.to_container(OmegaConf.load(grid_file))
    entries: dict[str, str] = {
        "drafter": ",".join(n for n in drafters.names() if n not in grid["exclude_drafters"]),
        **{key: ",".join(map(str, values)) for key, values in grid["sweep"].items()},
    }
    for item in [*grid["fixed"], *extra]:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not KEY=VALUE")
        entries[key] = value
    return [f"{key}={value}" for key, value in entries.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the default grid, then print the leaderboard.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. sampling.max_new_tokens=32")
    parser.add_argument("--dry-run", action="store_true", help="print the Hydra command and exit")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the leaderboard")
    args = parser.parse_args(argv)
    overrides = grid_overrides(args.overrides)
    command = [sys.executable, "-m", "experiments.run", "-m", *overrides]
    print(" ".join(command[1:]), flush=True)
    if args.dry_run:
        return 0
    results = next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("results.dir="))
    ResultsStore(results)  # an incompatible results directory fails here, before any work
    status = subprocess.run(command).returncode
    if status != 0:
        print(f"\nthe grid failed (exit {status}); the leaderboard below covers the cells stored so far\n",
              file=sys.stderr)
    try:
        markdown, out_dir = write_leaderboard(results, n_boot=args.bootstrap)
    except StoreError as err:  # no finished cell to rank
        print(f"no leaderboard: {err}", file=sys.stderr)
        return status or 1
    print(markdown)
    print(f"leaderboard, CSV, heatmaps and acceptance curves: {out_dir}", flush=True)
    table = pd.read_csv(out_dir / "leaderboard.csv")
    overall = table[table.category == "overall"]
    best = {metric: overall.loc[overall[metric].idxmax(), ["board", *ENTRY, "mal", "speedup"]].to_dict()
            for metric in ("mal", "speedup")}
    print(json.dumps({"results": str(results), "cells": len(ResultsStore(results).cell_ids()), "grid_exit": status,
                      "best_mal": best["mal"], "best_speedup": best["speedup"]}, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
