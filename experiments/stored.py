"""The cells of a results store as the report reads them: labels, rows, stored metadata and curves.

Owns `Cell` (one finished cell: its rows, its metadata, its latency curves and measured parts) and `load_cells`
(every cell of one setting, refusing cells the report cannot use). Knows nothing about verdicts, the cost model or
rendering: `experiments.report` and `experiments.costs` read cells from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from experiments import heldout
from experiments.leaderboard import N_BOOT, SETTING, stored_stats
from experiments.store import load_rows, open_existing
from experiments.verdict import Interaction, interaction
from specdec.core.curve import LatencyCurve
from specdec.measure import costmodel


class ReportError(ValueError):
    """A store the report cannot use (cells without latency curves, two cells for one entry, ...)."""


@dataclass
class Cell:
    """One stored cell: its labels, rows and stored metadata."""

    cell_id: str
    labels: dict
    rows: pd.DataFrame
    meta: dict
    stats: dict = field(default_factory=dict)

    @property
    def entry(self) -> tuple[str, str]:
        """(drafter, shape), the shape marked with its batch size in a batch cell (`chain(4) @b8`)."""
        batch = self.labels.get("batch", 1)
        return self.labels["drafter"], self.labels["shape"] + (f" @b{batch}" if batch > 1 else "")

    @property
    def quant(self) -> str:
        return self.labels["quant"]

    @property
    def numerics_only(self) -> bool:
        return bool(self.labels.get("numerics_only"))

    @property
    def control(self) -> bool:
        return bool(self.labels.get("control"))

    @property
    def name(self) -> str:
        return f"{self.entry[0]} {self.entry[1]} on {self.quant}"

    def curves(self) -> tuple[LatencyCurve, LatencyCurve]:
        """(target, reference) latency curves stored with the cell."""
        latency = self.meta["latency"]
        target = LatencyCurve.from_json(latency["target"], f"cell {self.cell_id} target curve")
        reference = latency.get("reference")
        return target, (LatencyCurve.from_json(reference, f"cell {self.cell_id} reference curve")
                        if reference is not None else target)

    def row_curves(self) -> tuple[dict[int, LatencyCurve], dict[int, LatencyCurve]]:
        """(target, reference) curves by rows per forward, 1 .. the cell's batch ({} for a cell stored
        without the fewer rows' curves, and for a batch-1 cell: its one curve is `curves()`)."""
        latency, out = self.meta["latency"], []
        for role, curve in zip(("target", "reference"), self.curves()):
            own = role if role in latency else "target"  # the fp32 cell is its own reference
            rows = latency.get(f"{own}_rows") or {}
            out.append({int(r): LatencyCurve.from_json(c, f"cell {self.cell_id} {own} curve at {r} rows")
                        for r, c in rows.items()} | ({curve.batch: curve} if rows else {}))
        return out[0], out[1]

    def parts(self) -> tuple[costmodel.RunParts, costmodel.RunParts, costmodel.RunParts]:
        """(drafted, plain, reference) measured parts, summed over the cell's rows (for projections; a
        batch cell's per batch step, `heldout.steps`)."""
        r = self.rows
        context = heldout.row_context(r, "new_tokens")

        def run(prefix: str) -> costmodel.RunParts:
            forwards, verify_s = heldout.steps(r, prefix)
            return costmodel.RunParts(
                new_tokens=int(r[f"{prefix}new_tokens"].sum()), forwards=forwards, context=context,
                prefill_s=float(r[f"{prefix}prefill_time_s"].sum()),
                other_s=float((r[f"{prefix}wall_time_s"] - r[f"{prefix}prefill_time_s"]).sum()) - verify_s)

        return run(""), run("baseline_"), run("reference_")


def load_cells(results: str | os.PathLike, n_boot: int = N_BOOT) -> list[Cell]:
    """Every finished cell of the store with its rows, metadata and stored statistics (`stored_stats`:
    the intervals every output prints); ReportError naming the cells that lack what the report needs,
    or two cells measuring one drafter x shape x kernel."""
    rows = load_rows(results)
    store = open_existing(results)
    cells, old = [], []
    for cid, part in rows.groupby("cell_id", sort=True):
        meta = store.read_meta(cid)
        if "latency" not in meta or part.get("reference_drafted_wall_time_s", pd.Series([np.nan])).isna().any():
            old.append(cid)
        else:
            rows_of_cell = part.reset_index(drop=True)
            cells.append(Cell(cid, {}, rows_of_cell, meta, stored_stats(store, cid, rows_of_cell, n_boot)))
    if old:
        names = ", ".join(old[:6]) + (", ..." if len(old) > 6 else "")
        raise ReportError(
            f"{len(old)} cell(s) of {results} lack the latency curves or the reference run the report needs "
            f"({names}): they were written by an older runner. Rerun them with this one into a new results.dir "
            "(python -m experiments.run -m ... results.dir=NEW, or python -m experiments.main results.dir=NEW); "
            "each cell then stores its target's latency curve (runner.latency_widths / latency_contexts)")
    settings = {tuple(str(part[k].iloc[0]) for k in SETTING) for _, part in rows.groupby("cell_id")}
    if len(settings) > 1:
        raise ReportError(f"{results} holds {len(settings)} settings ({', '.join(SETTING)} differ between cells); the "
                          "report compares cells of one setting: give each setting its own results.dir")
    seen: dict[tuple, str] = {}
    for cell in cells:
        first = cell.rows.iloc[0]
        cell.labels = {**first[["drafter", "shape", "quant", "bits", "model", "dataset", "prompts", "temperature",
                                "max_new_tokens"]].to_dict(),
                       "numerics_only": bool(first.get("numerics_only", False)),
                       "control": isinstance(first.get("control"), (bool, np.bool_)) and bool(first.get("control")),
                       "batch": int(first["batch"]) if pd.notna(first.get("batch", np.nan)) else 1}
        key = (cell.entry, cell.quant)
        if key in seen:
            raise ReportError(f"{results} holds two cells for {cell.name} ({seen[key]}, {cell.cell_id}): one was "
                              "measured under an older protocol (the cell key's `protocol`, experiments.run.PROTOCOL: "
                              "unpaired runs, or shared curves). Run the grid into a new results.dir")
        seen[key] = cell.cell_id
    return cells


def verdicts(cells: list[Cell], n_boot: int) -> dict[str, Interaction]:
    """{cell id: its interaction and verdict} for every cell on a kernel other than fp32 (one seeded bootstrap)."""
    rng = np.random.default_rng(0)
    return {c.cell_id: interaction(c.rows, n_boot, rng) for c in cells if c.quant != heldout.REFERENCE}


def cell_order(c: Cell) -> tuple:
    """The report's order of cells: speed before numerics, then by entry, the A/A control after its kernel cells."""
    return (c.numerics_only, c.entry, not c.control, c.quant != heldout.REFERENCE, c.quant)
