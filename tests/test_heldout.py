"""The held-out shape prediction on synthetic cells whose answer is worked out by hand: a chain(4)
cell's acceptance profile and a chain(2) cell's plain runs and curve give chain(2)'s speculation;
which deeper cell is used; and a store without a deeper profile leaves the kind absent with a note."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments import costs, heldout
from specdec.core.curve import LatencyCurve

WIDTHS = (1, 2, 3, 4, 5, 8)


def curve(a: float, b: float) -> LatencyCurve:
    """L(w) = a + b w at every context."""
    return LatencyCurve(target="m", device="cpu", dtype="float32", machine="test", threads=1, widths=WIDTHS,
                        contexts=(64, 256), seconds=tuple(tuple(a + b * w for w in WIDTHS) for _ in range(2)))


def deeper_rows(questions=("q0", "q1"), profile: bool = True) -> pd.DataFrame:
    """A chain(4) cell over `questions`: 20 steps, 0.4 s drafting and 0.6 s other bookkeeping. With
    `profile`: chain(2) replayed in 25 steps per question with 25 and 30 accepted tokens (MAL 1 + 55 / 50 = 2.1), and a drafting probe {1: 4 ms, 4: 10 ms} (the line
    2 ms + 2 ms per depth: chain(2) drafts 6 / 10 of chain(4)'s time, not 2 / 4)."""
    rows = []
    for i, _ in enumerate(questions):
        row = {"steps": 10, "draft_time_s": 0.2, "wall_time_s": 5.0, "prefill_time_s": 0.5, "verify_time_s": 4.0}
        if profile:
            row |= {"tf_chain_steps": [40, 25, 20, 18], "tf_chain_accepted": [20, 25 + 5 * (i % 2), 40, 45],
                    "draft_probe_s": {"1": 0.004, "4": 0.010}}
        rows.append(row)
    return pd.DataFrame([{"question_id": q, **r} for q, r in zip(questions, rows)])


def smaller_rows(questions=("q0", "q1")) -> pd.DataFrame:
    """A chain(2) cell: plain runs of 100 tokens in 11 s (1 s prefill, 100 one-token forwards in 10 s,
    so t_1 = 0.1 s) and drafted runs of 100 tokens in 50 steps and 10 s, summed over `questions`."""
    n = len(questions)
    return pd.DataFrame([{"question_id": q, "prompt_tokens": 60, "new_tokens": 100 / n, "steps": 50 / n,
                          "wall_time_s": 10.0 / n,
                          "baseline_new_tokens": 100 / n, "baseline_wall_time_s": 11.0 / n,
                          "baseline_prefill_time_s": 1.0 / n, "baseline_verify_time_s": 10.0 / n,
                          "baseline_steps": 100 / n} for q in questions])


def cell(cid: str, shape: str, quant: str, rows: pd.DataFrame, control: bool = False, drafter: str = "eagle",
         line: tuple[float, float] = (0.08, 0.02)) -> heldout.Measured:
    labels = {"drafter": drafter, "shape": shape, "quant": quant, "numerics_only": False, "control": control, "batch": 1}
    return heldout.Measured(cid, labels, rows, curve(*line))


def test_chain2_from_a_chain4_profile_by_hand():
    held, note = heldout.shape_predictions([cell("deep", "chain(4)", "int4", deeper_rows()),
                                            cell("small", "chain(2)", "int4", smaller_rows())])
    assert note is None and len(held) == 1
    (h,) = held
    assert (h.kind, h.cell_id, h.part) == ("shape", "small", "from chain(4) on int4")
    # By hand: MAL 2.1 (the replay), one width-3 forward per step, R(3) = (0.08 + 0.06) / (0.08 + 0.02) = 1.4,
    # delta = (0.6 + 0.4 * 0.6) / 20 = 0.042 s; T_d = 1 + 100 / 2.1 * (0.1 * 1.4 + 0.042) = 9.6667 s.
    assert h.predicted == pytest.approx(11.0 / (1 + 100 / 2.1 * 0.182))
    assert h.flat == pytest.approx(11.0 / (1 + 100 / 2.1 * 0.142))  # R = 1
    assert h.measured == pytest.approx((100 / 10) / (100 / 11))
    assert (h.mal, h.measured_mal, h.length_ratio) == pytest.approx((2.1, 2.0, 1.0))  # shown, never used
    frame = costs.table(held)
    assert frame.error[0] == pytest.approx(h.predicted / 1.1 - 1)
    assert frame.constant_error[0] == pytest.approx(1 - 1 / 1.1)


def test_the_score_breaks_down_by_kind_with_both_nulls():
    held, note = heldout.shape_predictions([cell("deep", "chain(4)", "int4", deeper_rows()),
                                            cell("small", "chain(2)", "int4", smaller_rows())])
    score = costs.score(costs.table(held), {"shape": note} if note else None)
    shape = score["by_kind"]["shape"]
    assert shape["n"] == 1 and shape["median_error"] == pytest.approx(abs(held[0].predicted / 1.1 - 1), abs=1e-4)
    assert shape["null_median_error"]["constant"] == pytest.approx(1 - 1 / 1.1, abs=1e-4)
    assert shape["null_median_error"]["flat_curve"] == pytest.approx(held[0].flat / 1.1 - 1, abs=1e-4)
    assert set(shape["null_within_25pct"]) == {"constant", "flat_curve"}
    assert score["heldout_median_error"] == shape["median_error"] and score["predictions"] == 1
    assert set(score["absent"]) == {"kernel", "prompts"}


def test_the_nearest_deeper_chain_on_the_same_kernel_is_used_and_the_control_counts_as_fp32():
    both = deeper_rows().merge(smaller_rows(), on="question_id", suffixes=("", "_drafted"))  # a chain(4) run and plain
    cells = [cell("a_deep8", "chain(8)", "none", deeper_rows()),
             cell("b_aa4", "chain(4)", "fp32_again", both, control=True),
             cell("c_int4", "chain(4)", "int4", deeper_rows()),
             cell("d_ngram4", "chain(4)", "none", deeper_rows(), drafter="ngram"),
             cell("small", "chain(2)", "none", smaller_rows())]
    held, note = heldout.shape_predictions(cells)
    # chain(4) (the A/A control: fp32 again) is predicted from chain(8); chain(2) from chain(4), not chain(8);
    # int4 and ngram have no deeper chain of their own.
    assert [(h.cell_id, h.part) for h in held] == [("b_aa4", "from chain(8) on none"),
                                                   ("small", "from chain(4) on fp32_again")]
    assert note is None


def test_only_the_questions_both_cells_ran_are_predicted():
    small = smaller_rows(("q0", "q1"))
    small.loc[1, "wall_time_s"] = 50.0  # q1 drafted ten times slower: it must not reach the prediction
    held, _ = heldout.shape_predictions([cell("deep", "chain(4)", "int4", deeper_rows(("q0",))),
                                         cell("small", "chain(2)", "int4", small)])
    assert held[0].measured == pytest.approx((50 / 5) / (50 / 5.5))
    # q0 alone: the replay's MAL 1 + 25 / 25 = 2.0; the rest is half of every sum.
    assert held[0].predicted == pytest.approx(11.0 / (1 + 100 / 2.0 * 0.182))


def test_without_a_deeper_profile_the_kind_is_absent_with_a_note():
    held, note = heldout.shape_predictions([cell("deep", "chain(4)", "int4", deeper_rows(profile=False)),
                                            cell("small", "chain(2)", "int4", smaller_rows())])
    assert held == [] and "no acceptance profile" in note and "deep" in note
    score = costs.score(costs.table(held), {"shape": note})
    assert score["predictions"] == 0 and score["absent"]["shape"] == note
    assert "by_kind" not in score and "heldout_median_error" not in score  # absent, never a zero


def test_one_shape_per_drafter_and_trees_are_stated():
    held, note = heldout.shape_predictions([cell("deep", "chain(4)", "int4", deeper_rows())])
    assert held == [] and note == heldout.ABSENT["shape"]
    held, note = heldout.shape_predictions([cell("deep", "chain(4)", "int4", deeper_rows()),
                                            cell("tree", "tree(2,2)", "int4", smaller_rows())])
    assert held == [] and "not predicted: tree(2,2) on int4" in note


def kernel_rows(probe: dict | None, reference_probe: dict | None = None) -> pd.DataFrame:
    """A chain(4) cell on a kernel, two questions: plain runs as `smaller_rows`; fp32 drafted runs of 100
    tokens in 40 steps of width 5 (phi_5 = 0.4) with 2 s outside the forwards, 1.6 s of it drafting (so
    0.01 s of bookkeeping and 0.04 s of drafting per step); the kernel's drafted runs (read only by the
    held-out prompts); the kernel's drafting probe `probe` and fp32's `reference_probe`."""
    rows = smaller_rows()
    return rows.assign(reference_drafted_new_tokens=50, reference_drafted_verify_widths=[{5: 20}, {5: 20}],
                       reference_drafted_wall_time_s=4.0, reference_drafted_prefill_time_s=0.5,
                       reference_drafted_verify_time_s=2.5, reference_drafted_draft_time_s=0.8,
                       prefill_time_s=0.5, verify_time_s=5.0, verify_widths=[{5: 25}, {5: 25}],
                       **({"draft_probe_s": [probe, probe]} if probe else {}),
                       **({"reference_draft_probe_s": [reference_probe] * 2} if reference_probe else {}))


def test_the_held_out_kernel_drafts_at_the_paired_probes_ratio_by_hand():
    """T_p = 11 s; R(5) = (0.08 + 0.1) / 0.1 = 1.8 on the kernel's curve; T_d = 1 + 100 * 0.4 * (0.1 * 1.8 +
    delta). The paired probe at depth 4 reads 0.09 s on the kernel and 0.06 s on fp32, so fp32's 0.04 s of
    drafting per step becomes 0.04 * 1.5 = 0.06: delta = 0.01 + 0.06, speculation = 11 / 11. Without fp32's probe
    (or any), fp32's 0.05 s per step stands (11 / 10.2) and the part says so; a tree is never scaled."""
    labels = {"drafter": "eagle", "shape": "chain(4)", "quant": "int4", "numerics_only": False, "batch": 1}
    probes = ({"1": 0.03, "4": 0.09}, {"1": 0.02, "4": 0.06})

    def kernel(rows, shape="chain(4)"):
        return [h for h in heldout.predictions("c", {**labels, "shape": shape}, rows, curve(0.08, 0.02))
                if h.kind == "kernel"]

    probed = kernel(kernel_rows(*probes))
    assert [h.part for h in probed] == ["all"]
    assert probed[0].predicted == pytest.approx(11 / 11)
    assert probed[0].flat == pytest.approx(11 / (1 + 40 * (0.1 + 0.07)))
    for rows in (kernel_rows(probes[0]), kernel_rows(None)):
        fallback = kernel(rows)
        assert [h.part for h in fallback] == ["all (fp32's drafting cost)"]
        assert fallback[0].predicted == pytest.approx(11 / 10.2)
    assert [h.part for h in kernel(kernel_rows(*probes), "tree(2,2)")] == ["all (fp32's drafting cost)"]


def two_halves(steps=(50, 25, 25, 20)) -> pd.DataFrame:
    """Four questions of one chain(4) cell (halves A = q0, q2 and B = q1, q3), each with a plain run of 100
    tokens in 11 s (1 s prefill, t_1 = 0.1 s) and a drafted run of 100 tokens in `steps` width-5 forwards,
    each costing what `curve(0.08, 0.02)` says (0.18 s) plus 0.02 s outside it: the model is exact in sample."""
    return pd.DataFrame([{"question_id": f"q{i}", "prompt_tokens": 60, "new_tokens": 100, "steps": s,
                          "verify_widths": {"5": s}, "prefill_time_s": 1.0, "verify_time_s": 0.18 * s,
                          "wall_time_s": 1.0 + 0.2 * s, "baseline_new_tokens": 100, "baseline_steps": 100,
                          "baseline_wall_time_s": 11.0, "baseline_prefill_time_s": 1.0, "baseline_verify_time_s": 10.0}
                         for i, s in enumerate(steps)])


def test_a_prompts_error_splits_into_the_mal_taken_from_the_other_half_and_the_cost_models_own_part():
    labels = {"drafter": "eagle", "shape": "chain(4)", "quant": "none", "numerics_only": False, "batch": 1}
    held = {h.part: h for h in heldout.predictions("c", labels, two_halves(), curve(0.08, 0.02))}
    b = held["B"]  # predicted from A: 200 tokens in 75 steps (MAL 2.67); B's own: 200 in 45 (MAL 4.44)
    assert b.predicted == pytest.approx(11.0 / (1 + 100 * 75 / 200 * 0.2))
    assert b.measured == pytest.approx(11.0 / (1 + 0.2 * 45 / 2))
    assert b.in_sample == pytest.approx(b.measured)  # fed its own MAL and delta, the model is exact here
    frame = costs.table(list(held.values())).set_index("part")
    assert frame.loc["B", "mal_error"] == pytest.approx(1 - (200 / 75) / (200 / 45))
    assert frame.loc["B", "in_sample_error"] == pytest.approx(0, abs=1e-12)
    # A's per-prompt MAL is 2 and 4 (coefficient of variation sqrt(2) / 3); two prompts against two.
    assert b.expected_mal_error == pytest.approx(2 ** 0.5 / 3 * (2 / 3.141592653589793) ** 0.5)
    score = costs.score(frame.reset_index())["by_kind"]["prompts"]
    assert score["in_sample_median_error"] == pytest.approx(0, abs=1e-4)  # shown apart ...
    assert score["median_error"] > 0.3 and not score["beats_nulls"]  # ... and never scored
    assert score["mal_median_error"] == pytest.approx(frame.mal_error.median(), abs=1e-4)
    assert score["expected_mal_median_error"] == pytest.approx(frame.expected_mal_error.median(), abs=1e-4)


def batch_groups() -> pd.DataFrame:
    """Two groups of two questions decoded at batch 2 (halves A = the first, B = the second), alike: a
    plain batch of 100 tokens in 6 s (1 s prefill, 50 batch steps of 0.1 s) and a drafted batch of 100
    tokens in 20 batch steps, each padded to width 5 (0.18 s on `curve(0.08, 0.02)`) plus 0.02 s outside
    the forward. The rows' own columns count each step once per row it served (40 steps, 7.2 s of
    verification, widths 3 and 5 unpadded), as `experiments.cell` stores them."""
    return pd.DataFrame([{"question_id": q, "rows": 2, "batch": 2, "prompt_tokens": 120, "new_tokens": 100,
                          "steps": 40, "verify_widths": {"3": 20, "5": 20}, "verify_time_s": 7.2,
                          "prefill_time_s": 1.0, "wall_time_s": 5.0, "batch_steps": 20,
                          "batch_verify_widths": {"5": 20}, "batch_verify_time_s": 3.6,
                          "baseline_new_tokens": 100, "baseline_steps": 100, "baseline_verify_time_s": 10.0,
                          "baseline_wall_time_s": 6.0, "baseline_prefill_time_s": 1.0, "baseline_batch_steps": 50,
                          "baseline_batch_verify_widths": {"1": 50}, "baseline_batch_verify_time_s": 5.0}
                         for q in ("q0+q1", "q2+q3")])


def test_a_batch_cell_is_predicted_from_its_batch_steps_by_hand():
    """T_p = 6 s; T_d = 1 + 100 * (20 / 100) * (0.1 * 1.8 + 0.02) = 5 s: 1.2x, as measured (the halves are
    alike). Read per row instead, the same runs would give other phi and a negative delta."""
    from dataclasses import replace

    labels = {"drafter": "eagle", "shape": "chain(4)", "quant": "none", "numerics_only": False, "batch": 2}
    rows, at_batch = batch_groups(), replace(curve(0.08, 0.02), batch=2)
    held = heldout.predictions("c", labels, rows, at_batch)
    assert [(h.part, h.shape) for h in held] == [("B", "chain(4) @b2"), ("A", "chain(4) @b2")]
    for h in held:
        assert h.measured == pytest.approx(1.2) and h.predicted == pytest.approx(1.2)
        assert h.mal == pytest.approx(5.0) and h.measured_mal == pytest.approx(5.0)  # tokens per batch step
    per_row = rows.drop(columns=[c for c in rows if "batch_" in c])
    assert heldout.predictions("c", labels, per_row, at_batch) == []  # stored before the batch steps
    wrong = heldout.draft_profile(per_row)
    assert wrong.other_per_step_s < 0 < heldout.draft_profile(rows).other_per_step_s
    with pytest.raises(ValueError, match="measured at batch 1"):
        heldout.predictions("c", labels, rows, curve(0.08, 0.02))


def test_a_batch_cell_with_its_rows_is_priced_per_row_count_by_hand():
    """The same groups, stored with their steps by (rows, width) and their forward seconds per shape: the
    plain batch ran 40 steps with both rows (3.2 s of forwards: f_2 = 0.08 s) and 10 with one (f_1 = 0.06
    s), 0.024 s per step besides; the drafted batch 15 steps of 2 rows and 5 of 1, all of width 5.
    T_d = 1 + 15 (0.08 L_2(5) / L_2(1) + 0.024 + 0.02) + 5 (0.06 L_1(5) / L_1(1) + 0.044) = 4.54 s with
    L_2 = 0.08 + 0.02 w and L_1 = 0.05 + 0.01 w; the halves are alike, so each half predicts 6 / 4.54."""
    from dataclasses import replace

    labels = {"drafter": "eagle", "shape": "chain(4)", "quant": "none", "numerics_only": False, "batch": 2}
    rows = batch_groups().assign(
        batch_verify_shapes=[{"2x5": 15, "1x5": 5}] * 2, batch_shape_forward_s=[{"2x5": 2.4, "1x5": 0.5}] * 2,
        baseline_batch_verify_shapes=[{"2x1": 40, "1x1": 10}] * 2,
        baseline_batch_shape_forward_s=[{"2x1": 3.2, "1x1": 0.6}] * 2)
    at_rows = {1: replace(curve(0.05, 0.01), batch=1), 2: replace(curve(0.08, 0.02), batch=2)}
    t_d = 1 + 15 * (0.08 * 0.18 / 0.1 + 0.044) + 5 * (0.06 * 0.10 / 0.06 + 0.044)
    held = heldout.predictions("c", labels, rows, at_rows[2], at_rows)
    assert [h.predicted for h in held] == pytest.approx([6 / t_d] * 2)
    # Without the curves by rows (a cell stored before them) the width-only price stands.
    assert [h.predicted for h in heldout.predictions("c", labels, rows, at_rows[2])] == pytest.approx([1.2, 1.2])


def test_a_batch_1_cell_beside_batch_cells_is_read_as_before():
    """In a store with batch cells every row has the batch columns, NaN in a batch-1 cell's rows: its
    prediction must be the one made without them (a NaN context once priced every forward at 0 s)."""
    labels = {"drafter": "eagle", "shape": "chain(4)", "quant": "none", "numerics_only": False, "batch": 1}
    alone = two_halves()
    beside = alone.assign(rows=float("nan"), batch_steps=float("nan"), batch_verify_widths=None,
                          batch_verify_time_s=float("nan"), baseline_batch_steps=float("nan"),
                          baseline_batch_verify_time_s=float("nan"))
    two_contexts = curve(0.08, 0.02)  # interpolates between contexts 64 and 256: a NaN context has no price
    assert heldout.plain_run(beside) == heldout.plain_run(alone)
    assert ([h.predicted for h in heldout.predictions("c", labels, beside, two_contexts)]
            == [h.predicted for h in heldout.predictions("c", labels, alone, two_contexts)])


def test_the_curve_fit_keeps_a_common_scale_out_of_the_shape_error_by_hand():
    """Plain runs of 10 one-token forwards in 1.0 s (0.1 s each) and drafted runs of 4 forwards of width 5
    in 0.8 s (0.2 s each). A curve L(w) = 0.075 + 0.025 w prices them 0.1 and 0.2 s: no gap. The same
    curve x 1.1 is off by +10% on both, and its shape error is 0; a curve twice as steep (0.05 + 0.05 w)
    has t1 gap 0 and width gap (0.3 / 0.2 - 1) = +50%, all of it shape error. A role the cell stored no
    curve for is left out, and so is a batch cell."""
    from types import SimpleNamespace

    from experiments import costs

    rows = pd.DataFrame([{"prompt_tokens": 60, "baseline_new_tokens": 10, "baseline_steps": 10,
                          "baseline_verify_time_s": 1.0, "new_tokens": 12, "verify_widths": {"5": 4},
                          "verify_time_s": 0.8} for _ in range(3)])

    def fake(line: tuple[float, float], batch: int = 1, name: str = "c") -> SimpleNamespace:
        return SimpleNamespace(name=name, labels={"batch": batch}, rows=rows, meta={"latency": {"target": {}}},
                               curves=lambda: (curve(*line), curve(*line)))

    fit = costs.curve_fit([fake((0.075, 0.025), name="exact"), fake((0.0825, 0.0275), name="scaled"),
                           fake((0.05, 0.05), name="steep"), fake((0.075, 0.025), batch=4)])
    assert list(fit.cell) == ["exact", "scaled", "steep"] and set(fit.role) == {"target"}
    by = fit.set_index("cell")
    assert by.loc["exact", ["t1_gap", "width_gap", "shape_error"]].tolist() == pytest.approx([0, 0, 0], abs=1e-12)
    assert by.loc["scaled", ["t1_gap", "width_gap", "shape_error"]].tolist() == pytest.approx([0.1, 0.1, 0], abs=1e-12)
    assert by.loc["steep", ["t1_gap", "width_gap", "shape_error"]].tolist() == pytest.approx([0, 0.5, 0.5], abs=1e-12)
    summary = costs.curve_fit_summary(fit)
    assert summary["n"] == 3 and summary["shape_error"] == pytest.approx(0) and summary["shape_error_max"] == 0.5
    assert costs.curve_fit_summary(fit.iloc[:0]) == {} and costs.curve_fit_md(fit.iloc[:0]) == []
