"""Predicted before measured: the interactions the main job prints before a cell runs, then measures.

Owns the mechanism control's prediction (its source drafter's in-run width cost, priced at the control's own
held-out widths: `predict_control`) and each drafted kernel cell's (`predict_cell`): `costmodel.predict_speculation`
on the kernel over fp32, fed the fp32 drafted and plain runs of that drafter x shape on held-out prompts
(RESULTS/profile), forwards and prefill scaled by the tune records' kernel / fp32 curves. Both are stored before
their cell runs; the scored cell is never read for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from experiments import heldout
from experiments.leaderboard import N_BOOT, atomic_text
from experiments.store import StoreError, load_rows
from experiments.stored import Cell, ReportError, cell_order, load_cells, verdicts
from experiments.verdict import Interaction
from specdec.core.curve import LatencyCurve
from specdec.measure import costmodel

CONTROL_FILE = "mechanism_control.json"
"""RESULTS/mechanism_control.json: the mechanism control's prediction, written before its cell runs."""
PREDICTION_FILE = "prediction.jsonl"
"""RESULTS/prediction.jsonl: one line per kernel cell predicted before it ran."""
PROFILE_DIR = "profile"
"""RESULTS/profile: the held-out prompts' fp32 drafted and plain runs the predictions read."""


def predict_control(results: str | os.PathLike, drafter: str, source: str, kernel: str) -> dict:
    """The mechanism control's interaction predicted from the width factor alone (acceptance, drafting and prefill
    taken as 1: a drafter that costs nearly nothing and accepts alike on both kernels), written to
    RESULTS/`CONTROL_FILE`. It reads the stored `source` drafter's cell on `kernel`: its in-run verify step in plain
    steps on each kernel (`r_kernel`, `r_fp32`) at its mean verify width w_s, taken as linear in the width,
    R(w) = 1 + (R(w_s) - 1)(w - 1) / (w_s - 1), and priced at the verify widths of `drafter`'s held-out fp32 runs
    (RESULTS/`PROFILE_DIR`): R_fp32 / R_kernel over those steps. Without that profile, the source cell's own width
    factor."""
    cells = [c for c in load_cells(results) if c.entry[0] == source and c.quant == kernel]
    found = verdicts(cells, N_BOOT)
    scored = [c for c in cells if found[c.cell_id].factors]
    if not scored:
        raise ReportError(f"no decomposed {source} cell on {kernel} in {results} to predict the {drafter} control from")
    cell, factors = scored[0], found[scored[0].cell_id].factors
    width, said = factors["width"][0], f"width factor of {scored[0].name}"
    mean = lambda widths: sum(w * n for w, n in widths.items()) / sum(widths.values())  # noqa: E731
    w_s, profile = mean(heldout.steps(cell.rows)[0]), Path(results) / PROFILE_DIR
    rows = load_rows(profile) if (profile / "cells").is_dir() else None
    rows = None if rows is None else rows[(rows.drafter == drafter) & (rows["shape"] == cell.entry[1])]
    if rows is not None and len(rows) and w_s > 1:
        mix, _ = heldout.steps(rows)
        r_k, r_0 = factors["r_kernel"][0], factors["r_fp32"][0]
        at = lambda r: sum(n * (1 + (r - 1) * (w - 1) / (w_s - 1)) for w, n in mix.items())  # noqa: E731
        width = at(r_0) / at(r_k)
        said = (f"{scored[0].name}'s in-run R({w_s:.1f}) {r_k:.2f} / fp32 {r_0:.2f}, at {drafter} {cell.entry[1]}'s "
                f"widths on {rows.question_id.nunique()} held-out prompts (mean {mean(mix):.2f})")
    record = {"drafter": drafter, "predicted": round(width, 4), "from": said}
    atomic_text(Path(results) / CONTROL_FILE, json.dumps(record) + "\n")
    return record


def _within(guess: float, point: float, lo: float, hi: float) -> bool:
    return bool(lo <= guess <= hi or abs(point - guess) <= 0.05)


def _beside(record: dict, v: Interaction) -> dict:
    """A stored prediction with the measured interaction, its CI and whether it falls within them (or 0.05); beside
    it, the measured interaction at equal acceptance (`timing`: the cell's own acceptance factor taken out, which a
    profile of other prompts cannot foresee) and whether the prediction falls within that."""
    guess, timing = record["predicted"], v.factors.get("timing")
    return record | {"measured": round(v.point, 4), "ci": [round(v.lo, 4), round(v.hi, 4)],
                     "within": _within(guess, v.point, v.lo, v.hi)} | ({} if timing is None else {
        "at_equal_acceptance": [round(x, 4) for x in timing], "within_at_equal_acceptance": _within(guess, *timing)})


def mechanism_control(results: str | os.PathLike, cells: list[Cell], found: dict[str, Interaction]) -> dict | None:
    """The JSON line's `mechanism_control` (None without a prediction or the control's cell)."""
    path = Path(results) / CONTROL_FILE
    record = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    cell = next((c for c in cells if c.cell_id in found and not c.numerics_only and not c.control
                 and c.entry[0] == record.get("drafter")), None)
    return None if cell is None else _beside(record, found[cell.cell_id])


def interaction_from(rows: pd.DataFrame, kernel: LatencyCurve, fp32: LatencyCurve, drafting: float = 1.0) -> float:
    """Speculation on the kernel over speculation on fp32 (`costmodel.predict_speculation` both), from the
    fp32 drafted and plain runs `rows` of other prompts: the kernel's plain run is fp32's with each forward
    scaled by L_k(1, c) / L_0(1, c) and the prefill by the ratio at the curves' widest width, its drafting
    per step by `drafting` (the tune records' draft step on the kernel over fp32's: `drafting_scale`)."""
    draft, plain = heldout.draft_profile(rows), heldout.plain_run(rows)
    c, widest = plain.context, min(kernel.widths[-1], fp32.widths[-1])
    forward = plain.forward_s * kernel.at(1, c) / fp32.at(1, c)
    prefill = plain.prefill_s * kernel.at(widest, c) / fp32.at(widest, c)
    steps = int(rows[heldout._column(rows, "baseline_", "steps")].sum())
    seconds = plain.seconds + prefill - plain.prefill_s + steps * (forward - plain.forward_s)
    on_kernel = costmodel.PlainRun(plain.new_tokens, seconds, prefill, forward, c)
    return (costmodel.predict_speculation(heldout.scaled_drafting(draft, rows, "", drafting), on_kernel, kernel)
            / costmodel.predict_speculation(draft, plain, fp32))


def drafting_scale(drafter: str, kernel: dict, fp32: dict) -> tuple[float, str]:
    """(scale, source): an EAGLE head's draft step on the kernel over fp32's, each the seconds of the dtype its tune
    record chose (`specdec.tune.measure_head_dtypes`); (1, why) for another drafter or a record without one."""
    if drafter != "eagle":
        return 1.0, f"{drafter}'s drafting taken as equal on both kernels"
    steps = [next((c["seconds_per_step"][c["dtype"]] for c in (r.get("head_dtype") or {}).values()), None)
             for r in (kernel, fp32)]
    if None in steps:
        return 1.0, "drafting taken as equal on both kernels (a tune record without the head's draft step)"
    return steps[0] / steps[1], f"draft step {1e3 * steps[0]:.1f} / {1e3 * steps[1]:.1f} ms (tune)"


def predict_cell(results: str | os.PathLike, name: str, drafter: str, shape: str, records: dict[str, dict],
                 sources: dict[str, str]) -> dict:
    """Predict cell `name` (drafter x shape on the kernel of tune record records["kernel"]) from RESULTS/`PROFILE_DIR`'s
    runs of that drafter x shape and records["fp32"]; appended to RESULTS/`PREDICTION_FILE` and returned."""
    from specdec.tune import record_curve

    rows = load_rows(Path(results) / PROFILE_DIR)
    rows = rows[(rows.drafter == drafter) & (rows["shape"] == shape)]
    if rows.empty:
        raise LookupError(f"no {drafter} {shape} runs in {Path(results) / PROFILE_DIR}")
    plain = heldout.plain_run(rows)  # `fp32_curve_over_runs`: how far the tune record is from this machine now
    curves = {role: record_curve(r) for role, r in records.items()}
    scale, said = drafting_scale(name.split(" ")[0], records["kernel"], records["fp32"])
    record = {"cell": name, "predicted": round(interaction_from(rows, curves["kernel"], curves["fp32"], scale), 4),
              "from": f"tune curves ({sources['kernel']}; {sources['fp32']}), {said}, and {drafter} {shape} on fp32 "
                      f"over {rows.question_id.nunique()} held-out prompts ({', '.join(sorted(set(rows.dataset)))})",
              "drafting_scale": round(scale, 3),
              "fp32_curve_over_runs": round(curves["fp32"].at(1, plain.context) / plain.forward_s, 3)}
    with open(Path(results) / PREDICTION_FILE, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")
    return record


def predictions(results: str | os.PathLike, cells: list[Cell], found: dict[str, Interaction]) -> list[dict]:
    """The JSON line's `prediction`: each cell's last stored prediction beside its measured interaction."""
    path = Path(results) / PREDICTION_FILE
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    stored = {r["cell"]: r for r in map(json.loads, lines)}
    return [_beside(stored[c.name], found[c.cell_id]) for c in cells if c.name in stored and c.cell_id in found]


def print_measured(results: str | os.PathLike) -> None:
    """Print each predicted cell stored so far: measured (with its CI) against predicted."""
    try:
        cells = sorted(load_cells(results), key=cell_order)
    except (ValueError, StoreError) as err:  # ReportError, or no cell yet
        return print(f"no measured interaction yet ({err})")
    for p in predictions(results, cells, verdicts(cells, N_BOOT)):
        print(f"measured after it ran, {p['cell']}: {text(p)}", flush=True)


def text(p: dict) -> str:
    """`predicted 0.80 (from ...), measured 0.78 [0.70, 0.85]: within its CI or 0.05` of a `_beside` record."""
    said = (f"predicted {p['predicted']:.2f} ({p['from']}), measured {p['measured']:.2f} [{p['ci'][0]:.2f}, "
            f"{p['ci'][1]:.2f}]: {'within' if p['within'] else 'NOT within'} its CI or 0.05")
    if "at_equal_acceptance" not in p:
        return said
    point, lo, hi = p["at_equal_acceptance"]
    return (f"{said}; at equal acceptance {point:.2f} [{lo:.2f}, {hi:.2f}]: "
            f"{'within' if p['within_at_equal_acceptance'] else 'NOT within'}")
