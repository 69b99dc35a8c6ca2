"""The report's cost-model parts: the out-of-sample score of the cost model and projections to other hardware.

Owns the held-out predictions of a store's cells and their score, their verdict line and REPORT.md section,
`curve_fit` (how each cell's curves match its own runs), the projection curves and table, and `md_table`. Knows
nothing about verdicts, acceptance or figures; a cell is an `experiments.stored.Cell`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pandas as pd

from experiments import heldout
from specdec.measure import costmodel
from specdec.core.curve import LatencyCurve

if TYPE_CHECKING:
    from experiments.stored import Cell

MODEL_TEXT = (
    "The model (equation and inputs: `specdec/measure/costmodel.py`'s docstring): a drafted run of N tokens takes "
    "T_d = P + N * sum_w phi_w * (t_1 * R(w, c) + delta), speculation = T_p / T_d. phi_w (forwards of width w per "
    "token) and delta (seconds per step outside the forward) come from other runs: the fp32 drafted runs of the same "
    "prompts, their drafting scaled by the kernel / fp32 ratio of the cell's paired drafting probe (*held-out "
    "kernel*), the other half of the prompts on the same kernel (*held-out prompts*), or the "
    "acceptance profile of a deeper chain of the same drafter x kernel (*held-out shape*: chain(k)'s MAL from that "
    "profile replayed in chain(k), its drafting per step from the line (fixed + per depth) through that cell's "
    "drafting probe, `costmodel.drafting_scale`; `experiments/heldout.py`); P, t_1, "
    "T_p from the kernel's plain runs; R(w, c) = L(w, c) / L(1, c) from the kernel's latency curve. The drafted runs "
    "predicted are never read, nor are the cell's own curves: each cell is priced on another cell's curve of its "
    "kernel (`cost_model.curves` says whose). Nulls: *constant* (speculation = 1.0x), *flat curve* (R = 1) and "
    "*transfer* (the measured speculation of the runs the prediction read: fp32's on the same prompts, the other "
    "half's, the deeper chain's; no model). Numerics-only cells, the A/A control's kernel prediction (fp32 from "
    "fp32: the twin) and cells no other cell's curve could price are listed but not scored.")


def md_table(header: list[str], lines: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(l) + " |" for l in lines)]


def table(held: list[heldout.HeldOut]) -> pd.DataFrame:
    """One line per prediction with its error, the nulls' errors, whether it is scored, and the two parts of
    the error shown apart: `mal_error` (the MAL taken from elsewhere against the runs' own) and `in_sample_error`."""
    return pd.DataFrame([{**h.__dict__, "error": h.error(h.predicted), "flat_error": h.error(h.flat),
                          "constant_error": h.error(1.0), "transfer_error": h.error(h.transfer),
                          "mal_error": abs(h.mal / h.measured_mal - 1), "in_sample_error": h.error(h.in_sample),
                          "scored": not (h.numerics_only or h.own_curve or (h.control and h.kind == "kernel"))}
                         for h in held])


def _scored(part: pd.DataFrame) -> dict:
    """within 25% and median error of the model and both nulls over `part`."""

    def med(column: str) -> float:
        return round(float(part[column].median()), 4)

    def shown(column: str) -> dict:
        """The median of a diagnostic column, under its own key, where any prediction has it."""
        values = part[column].dropna() if column in part else pd.Series(dtype=float)
        key = f"{column.removesuffix('_error')}_median_error"
        return {key: round(float(values.median()), 4)} if len(values) else {}

    def within(column: str) -> float:
        return round(float((part[column] <= heldout.WITHIN).mean()), 4)

    nulls = {"constant": "constant_error", "flat_curve": "flat_error", "transfer": "transfer_error"}
    medians = {k: med(c) for k, c in nulls.items() if part[c].notna().any()}
    return {"n": int(len(part)), "independent": int(part.cell_id.nunique()), "within_25pct": within("error"),
            "median_error": med("error"), "null_median_error": medians,
            "null_within_25pct": {k: within(c) for k, c in nulls.items() if k in medians},
            "beats_nulls": bool(within("error") >= 0.75 and med("error") <= min(medians.values()) / 2),
            **shown("mal_error"), **shown("in_sample_error"), **shown("expected_mal_error")}


def score(frame: pd.DataFrame, notes: Mapping[str, str] | None = None) -> dict:
    """The JSON line's `cost_model`: the held-out score over real kernels (every kind pooled), both nulls',
    the same per kind (`by_kind`), and `absent`: {kind: why} for each kind with no scored prediction
    (`notes` gives the why where the caller knows it)."""
    notes = dict(notes or {})
    scored = frame[frame.scored] if len(frame) else frame
    present = set(scored.kind) if len(scored) else set()
    predicted = set(frame.kind) if len(frame) else set()
    absent = {kind: notes.get(kind) or ("only numerics-only, A/A-twin or own-curve predictions were made"
                                        if kind in predicted else heldout.ABSENT[kind])
              for kind in heldout.KINDS if kind not in present}
    if scored.empty:
        return {"predictions": 0, "absent": absent,
                "note": "no held-out prediction could be made (no paired cells, or one prompt)"}
    pooled = _scored(scored)
    return {"heldout_within_25pct": pooled["within_25pct"], "heldout_median_error": pooled["median_error"],
            "null_median_error": pooled["null_median_error"], "null_within_25pct": pooled["null_within_25pct"],
            "predictions": pooled["n"], "independent_predictions": pooled["independent"],
            "by_kind": {kind: _scored(part) for kind, part in scored.groupby("kind", sort=True)},
            **({"absent": absent} if absent else {}), "beats_nulls": pooled["beats_nulls"],
            "speedup": "speculation (drafted / plain on the same kernel), predicted without its drafted runs"}


@dataclass(frozen=True)
class HeldOutScore:
    """Every held-out prediction of a store (`heldout.table`), its score (the JSON line's `cost_model`)
    and the note on shapes that could not be predicted."""

    held: pd.DataFrame
    score: dict
    shape_note: str | None


def borrowed_curves(cells: list[Cell]) -> dict[str, tuple[LatencyCurve, dict, str | None]]:
    """Per cell id: (target curve, its curves by rows, where from): the first other cell (by id) that stored a
    curve of the same target at the same batch, as its target (its curves by rows too) or its reference;
    else the cell's own, where from = None (`heldout.HeldOut.own_curve`: never scored)."""
    out = {}
    for cell in cells:
        own = cell.curves()[0]
        donor = next(((c, role, curve, rows) for c in sorted(cells, key=lambda c: c.cell_id) if c is not cell
                      for role, curve, rows in zip(("target", "reference"), c.curves(), c.row_curves())
                      if curve.target == own.target and curve.batch == own.batch), None)
        out[cell.cell_id] = ((donor[2], donor[3], f"{donor[0].name}'s {donor[1]} curve") if donor
                             else (own, cell.row_curves()[0], None))
    return out


def heldout_score(cells: list[Cell]) -> HeldOutScore:
    """Every held-out prediction, each cell priced on another cell's curve of its kernel (`borrowed_curves`),
    and the score; its `curves` names each cell's curve."""
    curves = borrowed_curves(cells)
    by_shape, shape_note = heldout.shape_predictions([heldout.Measured(
        c.cell_id, c.labels, c.rows, curves[c.cell_id][0], curves[c.cell_id][2] is None) for c in cells])
    held = table([replace(h, own_curve=curves[c.cell_id][2] is None) for c in cells for h in heldout.predictions(
        c.cell_id, c.labels, c.rows, *curves[c.cell_id][:2])] + by_shape)
    result = score(held, {"shape": shape_note} if shape_note else None)
    result["curves"] = {c.name: curves[c.cell_id][2] or "own curve (no other cell measured its kernel): not scored"
                        for c in cells}
    return HeldOutScore(held, result, shape_note)


def _pct(value: float | None, digits: int = 1) -> str:
    """A share as a percentage, an en dash where there is none."""
    return "–" if value is None or pd.isna(value) else f"{value:.{digits}%}"


def verdict_line(score: dict) -> list[str]:
    """The verdict's cost-model line ([] when nothing was predicted)."""
    if "heldout_median_error" not in score:
        return []
    met = "met" if score.get("beats_nulls") else "NOT met"
    failed = [k for k, v in score["by_kind"].items() if not v["beats_nulls"]]
    return [f"- Cost model out of sample, target (>= 75% within 25%, median error <= half the best null's) "
            f"{met}: {score['heldout_within_25pct']:.0%} within 25%, median error "
            f"{score['heldout_median_error']:.1%} vs nulls {_nulls(score['null_median_error'])} "
            f"({score['predictions']} predictions of {score['independent_predictions']} cells; "
            + ", ".join(f"{k} {v['median_error']:.1%}" for k, v in score["by_kind"].items())
            + (f"; fails its nulls: {', '.join(failed)}" if failed else "")
            + (f"; no {', '.join(score['absent'])}" if score.get("absent") else "") + ")"]


def _nulls(nulls: dict, pct=lambda v: f"{v:.1%}") -> str:  # noqa: ANN001 -- a formatter
    """`constant 1.0% / flat_curve 2.0% / transfer 3.0%` of a `null_*` dict."""
    return " / ".join(f"{k} {pct(v)}" for k, v in nulls.items())


def heldout_md(result: HeldOutScore) -> list[str]:
    """REPORT.md's section "Cost model, out of sample"."""
    score, shape_note, held = result.score, result.shape_note, result.held
    md: list[str] = []
    md += ["", "## Cost model, out of sample", "", MODEL_TEXT, "",
           f"Score (real kernels): **{score.get('heldout_within_25pct', float('nan')):.0%}** within 25%, median error "
           f"**{score.get('heldout_median_error', float('nan')):.1%}**; nulls: "
           f"{_nulls(score.get('null_median_error', {}))} (target: >= 75% within 25% and at most half the best "
           f"null's median error: {'met' if score.get('beats_nulls') else 'not met'}); "
           f"{score.get('predictions', 0)} predictions of "
           f"{score.get('independent_predictions', 0)} cells (a cell's predictions share its runs: count the cells as "
           "the independent ones).", "",
           *(f"**Held-out {kind} fails its nulls.**" for kind, k in score.get("by_kind", {}).items()
             if not k["beats_nulls"]), "", "![held-out](heldout.png)", ""]
    md += md_table(["held out", "predictions (cells)", "within 25%", "median error", "null median error",
                     "null within 25%", "MAL error (expected)", "in-sample error", "target met"],
                    [[f"held-out {kind}", f"{k['n']} ({k['independent']})", f"{k['within_25pct']:.0%}",
                      f"{k['median_error']:.1%}", _nulls(k["null_median_error"]),
                      _nulls(k["null_within_25pct"], lambda v: f"{v:.0%}"),
                      _pct(k.get("mal_median_error")) + (f" ({_pct(k['expected_mal_median_error'])})"
                                                         if "expected_mal_median_error" in k else ""),
                      _pct(k.get("in_sample_median_error")), "yes" if k["beats_nulls"] else "no"]
                     for kind, k in score.get("by_kind", {}).items()])
    md += ["", "Medians, shown apart and never scored: *MAL error*, the MAL a prediction took from elsewhere against "
           "the predicted runs' own (in brackets for held-out prompts, what the seen half's per-prompt spread "
           "expects of two sets of prompts of these sizes); *in-sample error*, the same model fed the predicted runs' "
           "own acceptance and drafting cost. The flat-curve null takes the same MAL, so the MAL error is common "
           "to the model and that null; the in-sample error is the cost model's own part."]
    notes = [*(f"- held-out {kind}: absent: {why}" for kind, why in score.get("absent", {}).items()),
             *([f"- held-out shape: {shape_note}"] if shape_note and "shape" not in score.get("absent", {}) else [])]
    md += ["", *notes, *([""] if notes else [])]
    if len(held):
        md += ["MAL used / measured: the MAL the prediction took from elsewhere and the predicted runs' own (in a "
               "batch cell, `@bB`, new tokens of all rows per batch step); "
               "tokens drafted / plain: the predicted runs' (the model takes the plain run's length). Both are shown "
               "to explain an error, never used by the prediction.", ""]
        md += md_table(["cell", "held out", "measured", "predicted", "flat-curve null", "error",
                         "null errors (const / flat / transfer)", "MAL used / measured", "in-sample error",
                         "tokens drafted / plain"],
                        [[f"{r.drafter} `{r['shape']}` {r.quant}" + (" (numerics only)" if r.numerics_only else "")
                          + (" (not scored)" if not r.scored and not r.numerics_only else ""),
                          f"held-out {r.kind} {r.part}", f"{r.measured:.2f}x", f"{r.predicted:.2f}x", f"{r.flat:.2f}x",
                          f"{r.error:.0%}", f"{r.constant_error:.0%} / {r.flat_error:.0%} / "
                          + _pct(r.transfer_error, 0),
                          f"{r.mal:.2f} / {r.measured_mal:.2f}", _pct(r.in_sample_error, 0), f"{r.length_ratio:.2f}"]
                         for _, r in held.sort_values(["numerics_only", "drafter", "shape", "quant", "kind", "part"]).iterrows()])
    return md


ROLES = (("target", "baseline_", ""), ("reference", "reference_", "reference_drafted_"))
"""(curve role, plain runs' prefix, drafted runs' prefix) of a paired cell."""


def curve_fit(cells: list[Cell]) -> pd.DataFrame:
    """Per batch-1 cell and curve role, how the stored curve matches the runs it prices (medians over
    prompts, each run at its own context: its prompt + half its new tokens):
    - *t1 gap*: the curve's one-token forward / the plain run's verify seconds per step - 1;
    - *width gap*: the curve's price of the drafted run's verify widths / its verify seconds - 1;
    - *shape error*: (1 + width gap) / (1 + t1 gap) - 1, the part the cost model sees (it anchors the
      curve's shape on the plain run, so a curve off by a common factor costs it nothing).
    A role the cell stored no curve or runs for (the fp32 cell is its own reference) is left out."""
    out = []
    for cell in cells:
        if cell.labels.get("batch", 1) != 1:
            continue  # a batch step's price needs its rows
        r = cell.rows
        for (role, plain, drafted), curve in zip(ROLES, cell.curves()):
            needed = [f"{plain}steps", f"{plain}verify_time_s", f"{drafted}verify_widths", f"{drafted}verify_time_s"]
            if cell.meta["latency"].get(role) is None or not all(c in r and r[c].notna().all() for c in needed):
                continue  # no curve of its own, or no such runs (a store from before the paired runs)
            t1 = [curve.at(1, p + n / 2) * s / v - 1 for p, n, s, v in zip(
                r.prompt_tokens, r[f"{plain}new_tokens"], r[f"{plain}steps"], r[f"{plain}verify_time_s"])]
            width = [sum(k * curve.at(int(w), p + n / 2) for w, k in widths.items()) / v - 1 for p, n, widths, v in zip(
                r.prompt_tokens, r[f"{drafted}new_tokens"], r[f"{drafted}verify_widths"], r[f"{drafted}verify_time_s"])]
            shape = [(1 + b) / (1 + a) - 1 for a, b in zip(t1, width)]
            out.append({"cell": cell.name, "role": role, "t1_gap": float(pd.Series(t1).median()),
                        "width_gap": float(pd.Series(width).median()), "shape_error": float(pd.Series(shape).median())})
    return pd.DataFrame(out, columns=["cell", "role", "t1_gap", "width_gap", "shape_error"])


def curve_fit_summary(fit: pd.DataFrame) -> dict:
    """The JSON line's `curves`: medians over cells x roles of each |gap|, the largest |shape error|."""
    if not len(fit):
        return {}
    gaps = fit[["t1_gap", "width_gap", "shape_error"]].abs()
    return {"n": len(fit), **{k: round(float(v), 4) for k, v in gaps.median().items()},
            "shape_error_max": round(float(gaps.shape_error.max()), 4)}


def curve_fit_md(fit: pd.DataFrame) -> list[str]:
    """REPORT.md's table of `curve_fit` ([] without a batch-1 cell)."""
    if not len(fit):
        return []
    return ["", "How each cell's curves match its own runs (median over prompts, each at its context): t1 gap = the "
            "curve's one-token forward against the plain runs' verify seconds per step; width gap = the curve's price "
            "of the drafted runs' verify widths against their verify seconds; shape error = (1 + width gap) / "
            "(1 + t1 gap) - 1, the only part the cost model sees (it anchors on the plain run).", "",
            *md_table(["cell", "curve", "t1 gap", "width gap", "shape error"],
                      [[r.cell, r.role, f"{r.t1_gap:+.1%}", f"{r.width_gap:+.1%}", f"{r.shape_error:+.1%}"]
                       for r in fit.itertuples()])]


def projection_curves(cells: list[Cell], devices: list[str], curve_files: list[str]) -> tuple[dict, list[str]]:
    """({projection name: {target label: curve}}, notes) from `NAME=CURVE_FILE` roofline devices (the
    file, measured on that device, gives the per-forward overhead) and curve files."""
    out: dict[str, dict[str, LatencyCurve]] = {}
    notes = []
    for item in devices:
        name, _, overhead_file = item.partition("=")
        dev = costmodel.device(name)
        if not overhead_file:
            notes.append(f"roofline {dev.name} dropped: no measured per-forward overhead (give --project-device "
                         f"{dev.name}=CURVE.json, a latency curve measured on a {dev.name}; none is assumed)")
            continue
        measured = LatencyCurve.load(overhead_file)
        curves: dict[str, LatencyCurve] = {}
        for cell in cells:
            sizes = cell.meta.get("model_sizes", {})
            for role, curve in zip(("target", "reference"), cell.curves()):
                if curve.target not in curves and role in sizes:
                    overhead = costmodel.measured_overhead(dev, measured, sizes[role])
                    curves[curve.target] = costmodel.roofline_curve(dev, sizes[role], curve.widths, curve.contexts,
                                                                    curve.target, overhead_s=overhead)
        out[f"roofline {dev.name}"] = curves
    if curve_files:
        files = [LatencyCurve.load(path) for path in curve_files]
        out["curve file " + ",".join(sorted({c.machine for c in files}))] = {c.target: c for c in files}
    return out, notes


def projection_table(cells: list[Cell], projections: dict[str, dict[str, LatencyCurve]]) -> pd.DataFrame:
    records = []
    for cell in cells:
        measured = cell.curves()
        record = {"name": cell.name, "numerics_only": cell.numerics_only}
        for name, curves in projections.items():
            pair = (curves.get(measured[0].target), curves.get(measured[1].target))
            if any(c is not None and c.batch != cell.labels.get("batch", 1) for c in pair):
                record[name] = f"– (curves of batch {pair[0].batch if pair[0] else pair[1].batch})"
            elif pair[0] is not None and pair[1] is not None:
                proj = costmodel.project(*cell.parts(), measured, pair)
                record[name] = f"{proj.speedup:.2f}x / {proj.speedup_compound:.2f}x"
        records.append(record)
    return pd.DataFrame(records)


def projection_md(cells: list[Cell], devices: list[str], curve_files: list[str]) -> list[str]:
    """REPORT.md's section "Projected to other hardware" ([] when no projection was asked for)."""
    projections, projection_notes = projection_curves(cells, devices, curve_files)
    md: list[str] = []
    if projections or projection_notes:
        md += ["", "## Projected to other hardware (projected, not measured)", "", *[f"- {n}" for n in projection_notes]]
        if projections:
            proj = projection_table(cells, projections)
            md += ["", "Speculation / compound, with every forward from the projection's curves; measured non-forward "
                   "times scaled by the ratio of one-token forward times; MAL as measured here.", ""]
            md += md_table(["cell", *projections], [[r["name"] + (" (numerics only)" if r["numerics_only"] else ""),
                                                       *(str(r.get(p, "")) for p in projections)] for _, r in proj.iterrows()])
    return md
