"""The cost model: speedups predicted from measured parts and a latency curve, MAL from acceptance per
depth, the out-of-sample speculation model and its flat-curve null, roofline curves whose overhead is
measured, projection. Pure arithmetic on hand-made curves: no model runs."""

from __future__ import annotations

import pytest

from specdec.measure import costmodel
from specdec.core.curve import LatencyCurve


def linear_curve(a: float, b: float, label: str = "m") -> LatencyCurve:
    """L(w, c) = a + b w at every context."""
    widths, contexts = (1, 2, 4, 8, 16, 32), (64, 256)
    return LatencyCurve(target=label, device="cpu", dtype="float32", machine="test", threads=1, widths=widths,
                        contexts=contexts, seconds=tuple(tuple(a + b * w for w in widths) for _ in contexts))


def parts(tokens: int, forwards: dict[int, int], prefill: float = 0.2, other: float = 0.0) -> costmodel.RunParts:
    return costmodel.RunParts(new_tokens=tokens, forwards=forwards, context=100.0, prefill_s=prefill, other_s=other)


def test_predict_by_hand():
    fp32, int4 = linear_curve(0.1, 0.005), linear_curve(0.05, 0.03)
    # 40 tokens: the drafted run takes 16 steps of width 5 (MAL 2.5) and 0.4 s of drafting.
    drafted, plain, reference = parts(40, {5: 16}, other=0.4), parts(40, {1: 40}), parts(40, {1: 40})
    pred = costmodel.predict(drafted, plain, reference, int4, fp32)
    t_drafted = 0.2 + 0.4 + 16 * (0.05 + 0.15)
    t_plain = 0.2 + 40 * 0.08
    t_reference = 0.2 + 40 * 0.105
    assert pred.speedup == pytest.approx(t_plain / t_drafted)
    assert pred.speedup_quant == pytest.approx(t_reference / t_plain)
    assert pred.speedup_compound == pytest.approx(t_reference / t_drafted)
    assert pred.speedup_compound == pytest.approx(pred.speedup * pred.speedup_quant)
    # Projecting with the curves measured here changes nothing.
    assert costmodel.project(drafted, plain, reference, (int4, fp32), (int4, fp32)) == pred


def test_wider_verify_costs_more_on_a_steep_curve():
    flat, steep = linear_curve(0.1, 0.001), linear_curve(0.1, 0.05)
    chain, tree = parts(40, {5: 16}), parts(40, {9: 12})  # the tree accepts more per step but is wider
    plain = parts(40, {1: 40})
    assert costmodel.predict(tree, plain, plain, flat, flat).speedup > costmodel.predict(chain, plain, plain, flat, flat).speedup
    assert costmodel.predict(tree, plain, plain, steep, steep).speedup < costmodel.predict(chain, plain, plain, steep, steep).speedup


def test_a_padded_curve_prices_a_width_at_its_bucket():
    """A compiled or graphed forward runs width 5 at bucket 8: its curve (`padded`, as `CurveTimer` times them) costs
    5 as 8, where an eager curve interpolates; the flag survives a round trip through JSON."""
    eager = linear_curve(0.1, 0.01)
    padded = LatencyCurve.from_json({**eager.to_json(), "padded": True})
    assert eager.at(5) == pytest.approx(0.15) and padded.at(5) == pytest.approx(eager.at(8)) == pytest.approx(0.18)
    assert padded.at(8) == eager.at(8) and padded.at(1) == eager.at(1) and padded.at(40) == eager.at(40)
    chain = parts(40, {5: 16})
    plain = parts(40, {1: 40})
    assert costmodel.predict(chain, plain, plain, padded, eager).speedup < costmodel.predict(chain, plain, plain,
                                                                                               eager, eager).speedup


def test_mal_from_acceptance():
    assert costmodel.mal_from_acceptance([10, 10, 10], [8, 5, 2], steps=10) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="no larger than reached"):
        costmodel.mal_from_acceptance([10, 4], [8, 5], steps=10)


SIZES = {"params": 1.35e8, "weight_bytes": 2.7e8, "layers": 30, "hidden": 576, "kv_heads": 3, "head_dim": 64,
         "kv_bytes_per_element": 2}


def test_drafting_scale_separates_a_fixed_part_from_the_part_per_depth():
    # Probe {1: 3 ms, 4: 6 ms}: the line 2 ms + 1 ms per depth; chain(2) drafts 4 / 6 of chain(4)'s time.
    assert costmodel.drafting_scale(2, 4, {1: 0.003, 4: 0.006}) == pytest.approx(4 / 6)
    assert costmodel.drafting_scale(1, 4, {1: 0.003, 4: 0.006}) == pytest.approx(3 / 6)
    # No fixed part: time proportional to depth, the scale is k / K.
    assert costmodel.drafting_scale(3, 6, {1: 0.002, 6: 0.012}) == pytest.approx(3 / 6)
    # Three depths: the least-squares line through (1, 3), (2, 5), (3, 4) is 3 + 0.5 d: at 2 -> 4, at 3 -> 4.5.
    assert costmodel.drafting_scale(2, 3, {1: 3.0, 2: 5.0, 3: 4.0}) == pytest.approx(4.0 / 4.5)
    with pytest.raises(ValueError, match="two or more depths"):
        costmodel.drafting_scale(2, 4, {4: 0.006})
    with pytest.raises(ValueError, match="no positive time"):
        costmodel.drafting_scale(1, 4, {2: 0.001, 4: 0.010})  # the line 0.0045 d - 0.008 is < 0 at 1


def test_roofline_is_memory_bound_at_width_one_and_compute_bound_when_wide():
    dev = costmodel.device("h200")  # names are case-insensitive
    curve = costmodel.roofline_curve(dev, SIZES, (1, 2, 4096), (0,), overhead_s=0.035)
    kv = 2 * 30 * 3 * 64 * 2
    assert curve.at(1, 0) == pytest.approx(0.035 + (2.7e8 + kv) / dev.bandwidth)
    flops = 2 * 1.35e8 * 4096 + 4 * 30 * 576 * 4096 * 4096
    assert curve.at(4096, 0) == pytest.approx(0.035 + flops / dev.flops)
    slower = costmodel.roofline_curve(costmodel.device("RTX3090"), SIZES, (1, 2), (0,), overhead_s=0.035)
    assert slower.at(1, 0) > curve.at(1, 0)


def test_overhead_is_measured_on_the_device_never_assumed():
    dev = costmodel.device("H200")
    measured = LatencyCurve(target="m", device="cuda", dtype="float32", machine="NVIDIA H200", threads=0,
                            widths=(1, 2), contexts=(64,), seconds=((0.035, 0.036),))
    roofline_1 = costmodel.roofline_curve(dev, SIZES, (1,), (64,), overhead_s=0.0).at(1, 64)
    assert costmodel.measured_overhead(dev, measured, SIZES) == pytest.approx(0.035 - roofline_1)
    with pytest.raises(ValueError, match="measured on 'test', not on a H200"):
        costmodel.measured_overhead(dev, linear_curve(0.1, 0.0), SIZES)
    with pytest.raises(TypeError):
        costmodel.roofline_curve(dev, SIZES, (1,), (64,))  # no default overhead


def test_held_out_speculation_by_hand():
    """40 tokens; the profile from elsewhere: 16 forwards of width 5 per 40 tokens, 0.025 s per step
    outside the forward. The plain run: 0.2 s prefill, 40 one-token forwards of 0.08 s, 3.5 s in all."""
    draft = costmodel.DraftProfile.from_runs(40, {5: 16}, other_s=0.4)
    assert draft.forwards_per_token == {5: 0.4} and draft.other_per_step_s == pytest.approx(0.025)
    plain = costmodel.PlainRun(new_tokens=40, seconds=3.5, prefill_s=0.2, forward_s=0.08, context=100.0)
    steep = linear_curve(0.05, 0.03)  # R(5) = 0.2 / 0.08 = 2.5
    t_drafted = 0.2 + 40 * 0.4 * (0.08 * 2.5 + 0.025)
    assert costmodel.predict_speculation(draft, plain, steep) == pytest.approx(3.5 / t_drafted)
    flat = 0.2 + 40 * 0.4 * (0.08 + 0.025)  # the null: a wide verification costs one-token forward
    assert costmodel.predict_speculation(draft, plain, None) == pytest.approx(3.5 / flat)
    # Only the curve's shape counts: scaling it (a curve taken under other load) changes nothing.
    assert costmodel.predict_speculation(draft, plain, linear_curve(0.1, 0.06)) == pytest.approx(3.5 / t_drafted)
    with pytest.raises(ValueError, match="needs tokens and steps"):
        costmodel.DraftProfile.from_runs(0, {5: 16}, other_s=0.4)


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown device 'tpu-v9'.*known devices: H200, H100, A100, RTX3090"):
        costmodel.device("tpu-v9")


def test_a_batch_is_predicted_with_its_own_batch_curve():
    """A curve at batch 8 predicts a batch-8 run; the batch-1 curve is refused for it, naming both."""
    plain = costmodel.PlainRun(new_tokens=40, seconds=3.5, prefill_s=0.2, forward_s=0.08, context=100.0, batch=8)
    draft = costmodel.DraftProfile({5: 0.5}, 0.001)
    flat = dict(target="t", device="cpu", dtype="float32", machine="m", threads=1, widths=(1, 8), contexts=(100,))
    steep = LatencyCurve(**flat, seconds=((1.0, 4.0),), batch=8)
    assert costmodel.predict_speculation(draft, plain, steep) < costmodel.predict_speculation(draft, plain, None)
    with pytest.raises(ValueError, match="measured at batch 1, the run decodes batch 8"):
        costmodel.predict_speculation(draft, plain, LatencyCurve(**flat, seconds=((1.0, 4.0),)))


def test_a_batch_step_is_priced_by_the_rows_still_decoding_by_hand():
    """A batch of 3 whose rows leave as they finish. The plain run: 30 tokens in 3.0 s (0.3 s prefill),
    its one-token forwards 0.2 s with 3 rows and 0.1 s with 1 row (never 2), 0.01 s per step besides.
    The drafted profile, per 30 tokens: 4 steps with 3 rows of width 5, 2 with 2 rows of width 5, 2 with
    1 row of width 2; 0.02 s per step outside the forward. Curves: L_1 = 0.05 + 0.01 w, L_2 = 0.08 +
    0.02 w, L_3 = 0.1 + 0.04 w. A step costs f_r R_r(w) + 0.01 + 0.02, f_2 from the curves: 0.2 x
    L_2(1) / L_3(1) = 0.2 x 0.1 / 0.14."""
    from dataclasses import replace

    draft = costmodel.DraftProfile.from_runs(30, {5: 6, 2: 2}, other_s=0.16, shapes={(3, 5): 4, (2, 5): 2, (1, 2): 2})
    assert draft.shapes_per_token == {(3, 5): 4 / 30, (2, 5): 2 / 30, (1, 2): 2 / 30}
    plain = costmodel.PlainRun(new_tokens=30, seconds=3.0, prefill_s=0.3, forward_s=0.15, context=100.0, batch=3,
                               row_forward_s={3: 0.2, 1: 0.1}, step_other_s=0.01)
    curves = {r: replace(linear_curve(a, b), batch=r) for r, a, b in ((1, 0.05, 0.01), (2, 0.08, 0.02), (3, 0.1, 0.04))}
    f2 = 0.2 * 0.1 / 0.14
    steps = (4 * (0.2 * 0.3 / 0.14 + 0.03) + 2 * (f2 * 0.18 / 0.1 + 0.03) + 2 * (0.1 * 0.07 / 0.06 + 0.03))
    assert costmodel.predict_speculation(draft, plain, curves[3], curves) == pytest.approx(3.0 / (0.3 + steps))
    # The flat null: every width free, a row count the plain run never reached at f_B.
    flat = 4 * (0.2 + 0.03) + 2 * (0.2 + 0.03) + 2 * (0.1 + 0.03)
    assert costmodel.predict_speculation(draft, plain, None, curves) == pytest.approx(3.0 / (0.3 + flat))
    # Without the curves by rows, every step is priced at the batch's width only, as before.
    width_only = 0.3 + 30 * (6 / 30 * (0.15 * 0.3 / 0.14 + 0.02) + 2 / 30 * (0.15 * 0.18 / 0.14 + 0.02))
    assert costmodel.predict_speculation(draft, plain, curves[3]) == pytest.approx(3.0 / width_only)
    with pytest.raises(ValueError, match="needs the curves at 2 and 3 rows, got curves at \\[1, 3\\] rows"):
        costmodel.predict_speculation(draft, plain, curves[3], {1: curves[1], 3: curves[3]})
    with pytest.raises(ValueError, match="7 steps by \\(rows, width\\) against 8 by width"):
        costmodel.DraftProfile.from_runs(30, {5: 6, 2: 2}, other_s=0.16, shapes={(3, 5): 4, (2, 5): 1, (1, 2): 2})
