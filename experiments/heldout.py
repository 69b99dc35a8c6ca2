"""The cost model scored out of sample: each cell's speculation speedup predicted only from runs it
was not measured in, beside two nulls.

Owns which runs predict which (the model itself, its inputs and its nulls are in
`specdec.measure.costmodel`), the per-prediction errors and the score of the report's JSON line:
- *kernel* (held-out kernel): the fp32 drafted runs of a paired cell's prompts (acceptance per verify
  width, drafting cost per step) + the kernel's latency-curve shape + the kernel's plain runs predict
  speculation on the kernel. The drafting cost per step is taken as fp32's (stated: a drafter that
  runs the target's own layers, e.g. self_draft, costs more or less on another kernel).
- *prompts* (held-out prompts): a cell's questions split in two halves (alternating, sorted by id);
  the drafted runs of one half predict the other half's speculation on the same kernel, both ways.
Errors are |predicted / measured - 1| of the pooled speculation speedup (tokens/s over the summed runs).
Nulls: *constant* (speculation = 1.0x) and *flat curve* (the same inputs, R(w) = 1). Numerics-only
cells (fp32 cost) are listed apart and left out of the score. Batch cells (`batch` > 1) are not
predicted yet: their rows record each row's own verify widths, while a batch step costs the padded
width of its widest row at the batch's curve (`costmodel.PlainRun.batch`), which the cells do not store. Knows nothing about files or figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from specdec.measure import costmodel
from specdec.measure.latency import LatencyCurve

WITHIN = 0.25
"""A prediction 'within 25%' has |predicted / measured - 1| <= WITHIN."""


@dataclass(frozen=True)
class HeldOut:
    """One out-of-sample prediction."""

    cell_id: str
    drafter: str
    shape: str
    quant: str
    numerics_only: bool
    kind: str
    """kernel or prompts (module docstring)."""
    part: str
    """Which runs were predicted: `all` prompts, or the half `A` / `B`."""
    measured: float
    predicted: float
    flat: float
    """The flat-curve null's prediction."""

    def error(self, value: float) -> float:
        return abs(value / self.measured - 1)


def _widths(column: pd.Series) -> dict[int, int]:
    out: dict[int, int] = {}
    for widths in column:
        for w, n in widths.items():
            out[int(w)] = out.get(int(w), 0) + int(n)
    return out


def draft_profile(rows: pd.DataFrame, prefix: str = "") -> costmodel.DraftProfile:
    """phi_w and delta from the drafted runs `prefix` (`""` = the kernel's, `reference_drafted_` = fp32's)."""
    other = (rows[f"{prefix}wall_time_s"] - rows[f"{prefix}prefill_time_s"] - rows[f"{prefix}verify_time_s"]).sum()
    return costmodel.DraftProfile.from_runs(int(rows[f"{prefix}new_tokens"].sum()),
                                            _widths(rows[f"{prefix}verify_widths"]), float(other))


def plain_run(rows: pd.DataFrame) -> costmodel.PlainRun:
    """The kernel's plain runs (`baseline_*`) summed over `rows`."""
    return costmodel.PlainRun(
        new_tokens=int(rows.baseline_new_tokens.sum()), seconds=float(rows.baseline_wall_time_s.sum()),
        prefill_s=float(rows.baseline_prefill_time_s.sum()),
        forward_s=float(rows.baseline_verify_time_s.sum() / rows.baseline_steps.sum()),
        context=float((rows.prompt_tokens + rows.baseline_new_tokens / 2).mean()))


def measured_speculation(rows: pd.DataFrame) -> float:
    """Pooled drafted tokens/s over plain tokens/s on the kernel."""
    return float((rows.new_tokens.sum() / rows.wall_time_s.sum())
                 / (rows.baseline_new_tokens.sum() / rows.baseline_wall_time_s.sum()))


def halves(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The rows of alternate questions (sorted ids): (A, B)."""
    ids = sorted(rows.question_id.unique(), key=str)
    a = set(ids[0::2])
    mask = rows.question_id.isin(a)
    return rows[mask], rows[~mask]


def predictions(cell_id: str, labels: dict, rows: pd.DataFrame, curve: LatencyCurve) -> list[HeldOut]:
    """Every held-out prediction of one cell (module docstring); `curve` is the cell's target curve."""
    common = {"cell_id": cell_id, "drafter": labels["drafter"], "shape": labels["shape"], "quant": labels["quant"],
              "numerics_only": bool(labels.get("numerics_only", False))}

    def one(kind: str, part: str, source: costmodel.DraftProfile, target: pd.DataFrame) -> HeldOut:
        plain = plain_run(target)
        return HeldOut(**common, kind=kind, part=part, measured=measured_speculation(target),
                       predicted=costmodel.predict_speculation(source, plain, curve),
                       flat=costmodel.predict_speculation(source, plain, None))

    out = []
    if int(labels.get("batch", 1) or 1) > 1:
        return out  # see the module docstring
    own_reference = labels["quant"] == "none"
    if not own_reference and "reference_drafted_verify_widths" in rows and rows.reference_drafted_verify_widths.notna().all():
        out.append(one("kernel", "all", draft_profile(rows, "reference_drafted_"), rows))
    a, b = halves(rows)
    if len(a) and len(b):
        out.append(one("prompts", "B", draft_profile(a), b))
        out.append(one("prompts", "A", draft_profile(b), a))
    return out


def table(held: list[HeldOut]) -> pd.DataFrame:
    """One line per prediction with its error and both nulls' errors."""
    return pd.DataFrame([{**h.__dict__, "error": h.error(h.predicted), "flat_error": h.error(h.flat),
                          "constant_error": h.error(1.0)} for h in held])


def score(frame: pd.DataFrame) -> dict:
    """The JSON line's `cost_model`: the held-out score over real kernels and both nulls'."""
    scored = frame[~frame.numerics_only] if len(frame) else frame
    if scored.empty:
        return {"predictions": 0, "note": "no held-out prediction could be made (no paired cells, or one prompt)"}

    def med(column: str) -> float:
        return round(float(scored[column].median()), 4)

    def within(column: str) -> float:
        return round(float((scored[column] <= WITHIN).mean()), 4)

    by_kind = {kind: {"n": int(len(part)), "within_25pct": round(float((part.error <= WITHIN).mean()), 4),
                      "median_error": round(float(part.error.median()), 4)}
               for kind, part in scored.groupby("kind", sort=True)}
    better_null = min(med("constant_error"), med("flat_error"))
    return {"heldout_within_25pct": within("error"), "heldout_median_error": med("error"),
            "null_median_error": {"constant": med("constant_error"), "flat_curve": med("flat_error")},
            "null_within_25pct": {"constant": within("constant_error"), "flat_curve": within("flat_error")},
            "predictions": int(len(scored)), "by_kind": by_kind,
            "beats_nulls": bool(within("error") >= 0.75 and med("error") <= better_null / 2),
            "speedup": "speculation (drafted / plain on the same kernel), predicted without its drafted runs"}

