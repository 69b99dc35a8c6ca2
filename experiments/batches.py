"""The report's batch section: speculation speedup against batch size, per drafter x shape x kernel.

Owns `batch_table` (geometric means of drafted / plain tokens/s over a cell's groups, with bootstrap intervals) and
`batch_section`. Knows nothing about stores or files.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from experiments.verdict import gmean_ci, per_question


def batch_table(rows: pd.DataFrame, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """One line per cell: drafter, shape, quant, batch, groups, speculation on the kernel and on fp32
    (point, lo, hi), sorted by drafter, shape, kernel, batch."""
    rng = np.random.default_rng(seed)
    rows = rows.assign(batch=rows["batch"].fillna(1).astype(int) if "batch" in rows else 1)
    out = []
    for (drafter, shape, quant, batch), cell in rows.groupby(["drafter", "shape", "quant", "batch"], sort=True):
        speed = per_question(cell)
        draws = rng.integers(0, len(speed), size=(n_boot, len(speed)))  # [B, Q], shared by the pair
        kernel = gmean_ci(np.log((speed.drafted / speed.plain).to_numpy(float)), draws)
        fp32 = gmean_ci(np.log((speed.reference_drafted / speed.reference).to_numpy(float)), draws)
        out.append({"drafter": drafter, "shape": shape, "quant": quant, "batch": int(batch), "groups": len(speed),
                    "speculation": kernel[0], "speculation_lo": kernel[1], "speculation_hi": kernel[2],
                    "fp32_speculation": fp32[0], "fp32_lo": fp32[1], "fp32_hi": fp32[2]})
    return pd.DataFrame(out)


def batch_section(rows: pd.DataFrame, n_boot: int = 2000) -> list[str]:
    """Markdown lines of the batch section; [] when the store holds one batch size only."""
    if "batch" not in rows or rows["batch"].fillna(1).nunique() < 2:
        return []
    table = batch_table(rows, n_boot)
    lines = ["## Speculation against batch size", "",
             "Drafted / plain tokens/s (all rows of a batch together), geometric mean over a cell's groups of "
             "prompts with a 95% bootstrap interval; the kernel's and fp32's from the same paired runs.", "",
             "| drafter | shape | kernel | batch | groups | speculation on the kernel | on fp32 |",
             "|---|---|---|---:|---:|---|---|"]
    for r in table.itertuples():
        lines.append(f"| {r.drafter} | `{r.shape}` | {r.quant} | {r.batch} | {r.groups} | "
                     f"{r.speculation:.2f} [{r.speculation_lo:.2f}, {r.speculation_hi:.2f}] | "
                     f"{r.fp32_speculation:.2f} [{r.fp32_lo:.2f}, {r.fp32_hi:.2f}] |")
    return [*lines, ""]
