"""The cost model scored out of sample: each cell's speculation speedup predicted only from runs it was not measured
in, beside three nulls. Owns which runs predict which (the model is `specdec.measure.costmodel`'s) and the
per-prediction errors (scored in `experiments.costs.score`):
- *kernel*: a paired cell's fp32 drafted runs (drafting scaled by the drafting probe, `kernel_profile`) with the
  kernel's curve and plain runs;
- *prompts*: alternating halves of the questions (sorted ids), each half's drafted runs predicting the other's;
- *shape*: a chain(k) cell from the nearest deeper chain(K) cell of its drafter and kernel: MAL replayed in chain(k)
  (`REPLAY`), delta scaled by `costmodel.drafting_scale(k, K, probe)`; trees and dynamic shapes are not predicted.
Errors are |predicted / measured - 1| of the pooled speedup. Shown, never scored: the MAL error, the in-sample error
and, for *prompts*, `expected_transfer`. Nulls: *constant* (1.0x), *flat curve* (R(w) = 1), *transfer* (measured
speculation of the runs read). Not scored: numerics-only cells, the A/A twin's *kernel* prediction and cells priced
on their own curve. Batch cells are priced by the rows still decoding (`shapes`: f_r R_r(w)).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from specdec.core.shapes import ChainShape, parse_shape
from specdec.measure import costmodel
from specdec.core.curve import LatencyCurve

WITHIN = 0.25
"""A prediction 'within 25%' has |predicted / measured - 1| <= WITHIN."""
KINDS = ("kernel", "prompts", "shape")
ABSENT = {"kernel": "no cell on a kernel other than fp32 carries paired fp32 drafted runs",
          "prompts": "no cell ran two or more questions",
          "shape": "no drafter x kernel ran a chain shorter than another chain of it"}
"""Why a kind has no prediction, when the caller gives no more specific note."""
REFERENCE = "none"
"""The fp32 kernel's label; an A/A control cell (`control`) measures it again under another label."""
REPLAY = ("tf_chain_steps", "tf_chain_accepted")
"""Per prompt, the acceptance profile replayed in chain(1..K): steps and accepted tokens
(`experiments.cell.teacher_forced`)."""
PROBE = "draft_probe_s"
"""{depth: median drafting seconds of a step} of the cell's drafting probe (`experiments.cell.drafting_probe`)."""
REFERENCE_PROBE = "reference_draft_probe_s"
"""The same for the fp32 drafter of a paired cell, measured interleaved with `PROBE`."""


@dataclass(frozen=True)
class HeldOut:
    """One out-of-sample prediction."""

    cell_id: str
    drafter: str
    shape: str
    quant: str
    numerics_only: bool
    kind: str
    """kernel, prompts or shape (module docstring)."""
    part: str
    """Which runs were predicted: `all` prompts, the half `A` / `B`, or (shape) `from SHAPE on KERNEL`."""
    measured: float
    predicted: float
    flat: float
    """The flat-curve null's prediction."""
    mal: float = float("nan")
    """The MAL the prediction used (1 / sum_w phi_w; a batch cell's: new tokens of all rows per batch step)."""
    measured_mal: float = float("nan")
    """The predicted runs' own MAL (drafted tokens / steps), shown beside it, never used."""
    length_ratio: float = float("nan")
    """Drafted tokens / plain tokens of the predicted runs (the model takes the plain run's N: a drafted run
    whose text left the plain one's and ended sooner spreads its prefill over fewer tokens), never used."""
    in_sample: float = float("nan")
    """The same model fed the predicted runs' own phi and delta (their drafted runs read: in sample), so the
    MAL taken from elsewhere is told apart from the cost model; shown, never scored."""
    expected_mal_error: float = float("nan")
    """*prompts* only: the MAL error two samples of these sizes are expected to show, from the seen half's
    per-prompt spread alone (`expected_transfer`); shown beside the MAL error, never used."""
    transfer: float = float("nan")
    """The transfer null: the measured speculation of the runs the prediction read, no model."""
    control: bool = False
    """An A/A control cell (its *kernel* prediction, fp32 from fp32, is the twin: never scored)."""
    own_curve: bool = False
    """Priced on the cell's own curve (no other cell measured its kernel): never scored."""

    def error(self, value: float) -> float:
        return abs(value / self.measured - 1)


def _summed(column: pd.Series, key: Callable[[str], Hashable] = int) -> dict:
    """The {key: value} dicts of a column added up, their keys read by `key`."""
    out: dict = {}
    for by_key in column:
        for k, value in by_key.items():
            out[key(k)] = out.get(key(k), 0) + value
    return out


def _widths(column: pd.Series) -> dict[int, int]:
    return {w: int(n) for w, n in _summed(column).items()}


def _column(rows: pd.DataFrame, prefix: str, name: str) -> str:
    """The column of the runs `prefix` that counts `name` (steps, verify_widths, verify_time_s) per step of
    the loop: a batch cell's per batch step (each padded to its widest row: `experiments.cell._batch_fields`;
    its rows' own columns count a step once per row it served), else the row's own."""
    batched = f"{prefix}batch_{name}"
    return batched if _has(rows, [batched]) else f"{prefix}{name}"


def steps(rows: pd.DataFrame, prefix: str = "") -> tuple[dict[int, int], float]:
    """(steps per verify width, seconds of those steps outside drafting) of the runs `prefix` over `rows`."""
    return (_widths(rows[_column(rows, prefix, "verify_widths")]),
            float(rows[_column(rows, prefix, "verify_time_s")].sum()))


def shapes(rows: pd.DataFrame, prefix: str = "", name: str = "verify_shapes") -> dict[tuple[int, int], float] | None:
    """A batch's {(rows still decoding, padded width): value} of the runs `prefix` summed over `rows`
    (`batch_verify_shapes`: steps; `batch_shape_forward_s`: forward seconds), None where not stored."""
    column = f"{prefix}batch_{name}"
    return _summed(rows[column], lambda k: tuple(map(int, k.split("x")))) if _has(rows, [column]) else None


def row_forwards(rows: pd.DataFrame, prefix: str) -> dict[int, float] | None:
    """f_r of the plain batch runs `prefix`: their mean one-token forward with r rows still decoding
    (None where the runs stored no forward times by shape)."""
    counts, forwards = shapes(rows, prefix), shapes(rows, prefix, "shape_forward_s")
    if not counts or not forwards:
        return None
    return {r: forwards[r, w] / k for (r, w), k in counts.items() if w == 1}


def draft_profile(rows: pd.DataFrame, prefix: str = "") -> costmodel.DraftProfile:
    """phi_w and delta from the drafted runs `prefix` (`""` = the kernel's, `reference_drafted_` = fp32's)."""
    widths, verify_s = steps(rows, prefix)
    other = float((rows[f"{prefix}wall_time_s"] - rows[f"{prefix}prefill_time_s"]).sum()) - verify_s
    return costmodel.DraftProfile.from_runs(int(rows[f"{prefix}new_tokens"].sum()), widths, other, shapes(rows, prefix))


def _has(rows: pd.DataFrame, columns: Sequence[str]) -> bool:
    """Every row of `rows` has a value in each of `columns`."""
    return all(c in rows and rows[c].notna().all() for c in columns)


def _probe(rows: pd.DataFrame, column: str) -> dict[str, float]:
    """{str(depth): seconds} of a probe column (`PROBE`, `REFERENCE_PROBE`), {} where the cell has none."""
    if not _has(rows, [column]):
        return {}
    return {str(d): float(t) for d, t in rows[column].iloc[0].items()}


def kernel_profile(rows: pd.DataFrame, k: int | None) -> tuple[costmodel.DraftProfile, bool]:
    """phi_w and the bookkeeping per step of the fp32 drafted runs, with their drafting per step scaled by the paired
    probe's ratio at depth `k` (the kernel's drafting over fp32's, measured interleaved: `PROBE` / `REFERENCE_PROBE`);
    (profile, True) when both probes were there, else fp32's drafting stands (False)."""
    fp32 = draft_profile(rows, "reference_drafted_")
    on_kernel, on_fp32 = _probe(rows, PROBE), _probe(rows, REFERENCE_PROBE)
    if str(k) not in on_kernel or str(k) not in on_fp32 or "reference_drafted_draft_time_s" not in rows:
        return fp32, False
    return scaled_drafting(fp32, rows, "reference_drafted_", on_kernel[str(k)] / on_fp32[str(k)]), True


def scaled_drafting(profile: costmodel.DraftProfile, rows: pd.DataFrame, prefix: str,
                    scale: float) -> costmodel.DraftProfile:
    """`profile` (of the drafted runs `prefix` over `rows`) with their drafting per step scaled by `scale`."""
    drafting = float(rows[f"{prefix}draft_time_s"].sum()) / sum(_widths(rows[f"{prefix}verify_widths"]).values())
    return costmodel.DraftProfile(profile.forwards_per_token, profile.other_per_step_s + drafting * (scale - 1),
                                  profile.shapes_per_token)


def _batch(rows: pd.DataFrame) -> int:
    """The batch size `rows` were decoded at (1 for rows stored without one)."""
    return int(rows["batch"].iloc[0]) if "batch" in rows and pd.notna(rows["batch"].iloc[0]) else 1


def row_context(rows: pd.DataFrame, tokens: str = "baseline_new_tokens") -> float:
    """c: a row's mean cached tokens at a step, its prompt + half the `tokens` column (a batch row holds
    `rows` prompts; NaN there is a batch-1 cell in a store with batch cells)."""
    members = rows["rows"].fillna(1) if "rows" in rows else 1
    return float(((rows.prompt_tokens + rows[tokens] / 2) / members).mean())


def plain_run(rows: pd.DataFrame) -> costmodel.PlainRun:
    """The kernel's plain runs (`baseline_*`) summed over `rows` (a batch cell's: t_1 is a batch step's, c a row's)."""
    n, verify_s = (rows[_column(rows, "baseline_", name)].sum() for name in ("steps", "verify_time_s"))
    by_rows, row_forward_s = {}, row_forwards(rows, "baseline_")
    if row_forward_s is not None:  # a batch's one-token forward per row count, and the rest of its steps
        forwards = shapes(rows, "baseline_", "shape_forward_s")
        by_rows = {"row_forward_s": row_forward_s, "step_other_s": float(verify_s - sum(forwards.values())) / n}
    return costmodel.PlainRun(
        new_tokens=int(rows.baseline_new_tokens.sum()), seconds=float(rows.baseline_wall_time_s.sum()),
        prefill_s=float(rows.baseline_prefill_time_s.sum()), forward_s=float(verify_s / n),
        context=row_context(rows), batch=_batch(rows), **by_rows)


def diagnostics(draft: costmodel.DraftProfile, rows: pd.DataFrame) -> dict[str, float]:
    """`HeldOut.mal`, `measured_mal` and `length_ratio` of a prediction of `rows` from `draft`."""
    return {"mal": 1.0 / sum(draft.forwards_per_token.values()),
            "measured_mal": float(rows.new_tokens.sum() / rows[_column(rows, "", "steps")].sum()),
            "length_ratio": float(rows.new_tokens.sum() / rows.baseline_new_tokens.sum())}


def in_sample(rows: pd.DataFrame, curve: LatencyCurve, row_curves: Mapping[int, LatencyCurve] | None = None) -> float:
    """`HeldOut.in_sample` of `rows` (NaN where they lack the drafted runs' timings)."""
    if not _has(rows, ("verify_widths", "prefill_time_s", "verify_time_s")):
        return float("nan")
    return costmodel.predict_speculation(draft_profile(rows), plain_run(rows), curve, row_curves)


def expected_transfer(seen: pd.DataFrame, unseen: pd.DataFrame) -> float:
    """|MAL_seen / MAL_unseen - 1| expected between two random sets of prompts of these sizes when per-prompt
    MAL has the seen set's coefficient of variation v (normal approximation): v sqrt(2 / pi)
    sqrt(1 / n_seen + 1 / n_unseen). Reads only the seen set's drafted runs and the unseen set's size."""
    per_prompt = seen.groupby("question_id")[["new_tokens", "steps"]].sum()
    mal = per_prompt.new_tokens / per_prompt.steps
    if len(mal) < 2 or mal.mean() <= 0:
        return float("nan")
    v = float(mal.std(ddof=1) / mal.mean())
    return v * (2 / np.pi) ** 0.5 * (1 / len(mal) + 1 / unseen.question_id.nunique()) ** 0.5


def measured_speculation(rows: pd.DataFrame, drafted: str = "", plain: str = "baseline_") -> float:
    """Pooled drafted tokens/s over plain tokens/s on the kernel (`reference_drafted_`, `reference_`: on fp32;
    NaN where the rows lack those runs)."""
    if not _has(rows, [f"{drafted}wall_time_s", f"{plain}wall_time_s"]):
        return float("nan")
    return float((rows[f"{drafted}new_tokens"].sum() / rows[f"{drafted}wall_time_s"].sum())
                 / (rows[f"{plain}new_tokens"].sum() / rows[f"{plain}wall_time_s"].sum()))


def halves(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The rows of alternate questions (sorted ids): (A, B)."""
    ids = sorted(rows.question_id.unique(), key=str)
    a = set(ids[0::2])
    mask = rows.question_id.isin(a)
    return rows[mask], rows[~mask]


def predictions(cell_id: str, labels: dict, rows: pd.DataFrame, curve: LatencyCurve,
                row_curves: Mapping[int, LatencyCurve] | None = None) -> list[HeldOut]:
    """Every held-out prediction of one cell (module docstring); `curve` is the cell's target curve,
    `row_curves` a batch cell's target curves by rows per forward ({} or None: priced by width only)."""
    batch = int(labels.get("batch", 1) or 1)
    common = {"cell_id": cell_id, "drafter": labels["drafter"], "quant": labels["quant"],
              "shape": labels["shape"] + (f" @b{batch}" if batch > 1 else ""),  # as the report names the cell
              "numerics_only": bool(labels.get("numerics_only", False)), "control": bool(labels.get("control"))}

    def one(kind: str, part: str, source: costmodel.DraftProfile, target: pd.DataFrame, **extra) -> HeldOut:
        plain = plain_run(target)
        return HeldOut(**common, kind=kind, part=part, measured=measured_speculation(target),
                       predicted=costmodel.predict_speculation(source, plain, curve, row_curves),
                       flat=costmodel.predict_speculation(source, plain, None, row_curves),
                       **diagnostics(source, target), in_sample=in_sample(target, curve, row_curves), **extra)

    out = []
    if batch > 1 and not _has(rows, ["batch_verify_widths"]):
        return out  # see the module docstring
    own_reference = labels["quant"] == "none"
    if not own_reference and _has(rows, ["reference_drafted_verify_widths"]):
        shape = parse_shape(labels["shape"])
        profile, probed = kernel_profile(rows, shape.k if isinstance(shape, ChainShape) else None)
        out.append(one("kernel", "all" if probed else "all (fp32's drafting cost)", profile, rows,
                       transfer=measured_speculation(rows, "reference_drafted_", "reference_")))
    a, b = halves(rows)
    if len(a) and len(b):
        out.append(one("prompts", "B", draft_profile(a), b, expected_mal_error=expected_transfer(a, b),
                       transfer=measured_speculation(a)))
        out.append(one("prompts", "A", draft_profile(b), a, expected_mal_error=expected_transfer(b, a),
                       transfer=measured_speculation(b)))
    return out


@dataclass(frozen=True)
class Measured:
    """What the shape predictions read of one stored cell."""

    cell_id: str
    labels: dict
    """drafter, shape, quant, numerics_only, control, batch (the report's cell labels)."""
    rows: pd.DataFrame
    curve: LatencyCurve
    """The target latency curve the cell is priced on (another cell's measurement of its kernel, where one was)."""
    own_curve: bool = False
    """`curve` is the cell's own (`HeldOut.own_curve`)."""

    @property
    def kernel(self) -> str:
        return REFERENCE if self.labels.get("control") else self.labels["quant"]

    @property
    def chain(self) -> int | None:
        """k of a chain(k) cell at batch 1, else None."""
        shape = parse_shape(self.labels["shape"])
        return shape.k if isinstance(shape, ChainShape) and int(self.labels.get("batch", 1) or 1) == 1 else None

    def has_profile(self) -> bool:
        """The replayed profile and the drafting probe a shorter chain is predicted from."""
        return _has(self.rows, [*REPLAY, PROBE])


def pooled(column: pd.Series) -> list[int]:
    """Per-depth counts summed over rows (lists of unequal length padded with 0)."""
    out: list[int] = []
    for counts in column:
        out += [0] * (len(counts) - len(out))
        for d, n in enumerate(counts):
            out[d] += int(n)
    return out


def replayed_mal(deeper: pd.DataFrame, k: int) -> float:
    """Pooled MAL of chain(k) replayed on the deeper cell's teacher-forced profiles: 1 + accepted / steps."""
    steps = sum(int(r[k - 1]) for r in deeper[REPLAY[0]])
    return 1.0 + sum(int(r[k - 1]) for r in deeper[REPLAY[1]]) / steps


def chain_profile(deeper: pd.DataFrame, k: int, depth: int) -> costmodel.DraftProfile:
    """phi and delta of chain(k) from the rows of a chain(`depth`) cell (module docstring, *shape*)."""
    mal = replayed_mal(deeper, k)
    scale = costmodel.drafting_scale(k, depth, {int(d): t for d, t in _probe(deeper, PROBE).items()})
    n_steps = int(deeper.steps.sum())  # batch 1 (`Measured.chain`): a row's own steps
    drafting = float(deeper.draft_time_s.sum())
    other = float((deeper.wall_time_s - deeper.prefill_time_s - deeper.verify_time_s).sum())
    return costmodel.DraftProfile({k + 1: 1.0 / mal}, (other - drafting + drafting * scale) / n_steps)


def shape_predictions(cells: Sequence[Measured]) -> tuple[list[HeldOut], str | None]:
    """Each chain cell predicted from the nearest deeper chain cell of its drafter x kernel that has an
    acceptance profile (ties: the same kernel label first, then cell id), and a note on what could not
    be predicted (None when nothing was left out)."""
    out, missing, trees = [], [], []
    for small in sorted(cells, key=lambda c: c.cell_id):
        group = [c for c in cells if c is not small and c.labels["drafter"] == small.labels["drafter"]
                 and c.kernel == small.kernel and int(c.labels.get("batch", 1) or 1) == 1]
        if small.chain is None:
            if group and int(small.labels.get("batch", 1) or 1) == 1:
                trees.append(f"{small.labels['shape']} on {small.labels['quant']}")
            continue
        deeper = sorted((c for c in group if c.chain is not None and c.chain > small.chain),
                        key=lambda c: (c.chain, c.labels["quant"] != small.labels["quant"], c.cell_id))
        source = next((c for c in deeper if c.has_profile()), None)
        if source is None:
            missing += [c.cell_id for c in deeper]
            continue
        target = small.rows[small.rows.question_id.isin(set(source.rows.question_id))]
        if target.empty:
            missing.append(f"{source.cell_id} (no question in common with {small.cell_id})")
            continue
        seen = source.rows[source.rows.question_id.isin(set(target.question_id))]
        draft, plain = chain_profile(seen, small.chain, source.chain), plain_run(target)
        out.append(HeldOut(cell_id=small.cell_id, drafter=small.labels["drafter"], shape=small.labels["shape"],
                           quant=small.labels["quant"], numerics_only=bool(small.labels.get("numerics_only", False)),
                           kind="shape", part=f"from {source.labels['shape']} on {source.labels['quant']}",
                           measured=measured_speculation(target), transfer=measured_speculation(seen),
                           control=bool(small.labels.get("control")), own_curve=small.own_curve,
                           predicted=costmodel.predict_speculation(draft, plain, small.curve),
                           flat=costmodel.predict_speculation(draft, plain, None), **diagnostics(draft, target),
                           in_sample=in_sample(target, small.curve)))
    notes = []
    if missing:
        notes.append(f"no acceptance profile ({' / '.join(REPLAY)} / {PROBE}: T = 0 and runner.teacher_forcing) in "
                     f"{', '.join(dict.fromkeys(missing))}")
    if trees:
        notes.append(f"not predicted: {', '.join(trees)} (a smaller tree is cut out of a recorded tree's drafts, "
                     "which cells do not store; only chains shorter than a recorded chain are predicted)")
    if not out and not notes:
        notes.append(ABSENT["shape"])
    return out, "; ".join(notes) or None
