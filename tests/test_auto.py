"""`shape="auto"`: parsing and bad options, the estimator's arithmetic, the shapes it picks under a
steep and a flat (synthetic) latency curve, and exactness for every drafter."""

import numpy as np
import pytest

import specdec
import specdec.auto
from specdec.auto import AutoPolicy, candidate_widths
from specdec.drafters import build_for_tests
from specdec.latency import LatencyCurve
from specdec.reference import reference_generate
from specdec.shapes import AutoShape, parse_shape

PROMPT = [3, 5, 7, 3, 5, 7, 3, 5, 9, 3, 5]
WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def curve(seconds_per_width) -> LatencyCurve:
    return LatencyCurve(target="synthetic", device="cpu", dtype="float64", machine="test", threads=1,
                        widths=WIDTHS, contexts=(256,), seconds=(tuple(seconds_per_width(w) for w in WIDTHS),))


STEEP = curve(lambda w: 1.0 * w)  # every extra token costs a whole forward: drafting never pays
FLAT = curve(lambda w: 1.0)  # width is free: the widest tree pays


def test_auto_parses_and_bad_options_fail_before_generation(tiny_llama64):
    assert parse_shape("auto") == AutoShape()
    assert parse_shape("auto(max_depth=3,max_width=2)") == AutoShape(max_depth=3, max_width=2)
    for bad, match in [("auto(depth=3)", "unknown: depth"), ("auto(3)", "keyword options"),
                       ("auto(max_nodes=0)", "max_nodes")]:
        with pytest.raises(ValueError, match=match):
            specdec.generate(tiny_llama64, None, PROMPT, shape=bad, max_new_tokens=2)


def test_a_wide_menu_is_enumerated_within_the_node_budget():
    """auto(max_width=64) used to enumerate C(71, 8) width vectors before filtering by max_nodes
    (it never returned); only vectors within the budget are grown now, in the same order."""
    assert candidate_widths(3, 3, 12) == [(3,), (2,), (1,), (3, 3), (3, 2), (3, 1), (2, 2), (2, 1), (1, 1),
                                          (3, 1, 1), (2, 2, 1), (2, 1, 1), (1, 1, 1)]
    wide = candidate_widths(8, 64, 32)
    assert len(wide) == 127 and (32,) in wide and (1,) * 8 in wide and (33,) not in wide
    assert AutoPolicy(AutoShape(max_width=64, latency=FLAT)).width_table.shape == (127, 8)


def test_estimator_arithmetic():
    """E[accepted] = sum_d prod_{i<=d} q_i with q_i = 1 - prod_{r<w_i}(1 - s[i, r])."""
    assert candidate_widths(2, 2, 6) == [(2,), (1,), (2, 2), (2, 1), (1, 1)]
    policy = AutoPolicy(AutoShape(max_depth=2, max_width=2, max_nodes=6, latency=FLAT))
    policy.successes[:] = [[1, 2], [0, 0]]  # s = (succ + 1) / (trials + 4), the Beta(1, 3) prior
    policy.trials[:] = [[2, 2], [2, 2]]  # -> s = [[1/3, 1/2], [1/6, 1/6]]
    a, b, c = 1 / 3, 1 / 2, 1 / 6
    q1_2, q2_2 = 1 - (1 - a) * (1 - b), 1 - (1 - c) ** 2
    expected = {(2,): q1_2, (1,): a, (2, 2): q1_2 + q1_2 * q2_2, (2, 1): q1_2 + q1_2 * c, (1, 1): a + a * c}
    got = dict(zip(policy.widths, policy.expected_accepted()))
    for widths, value in expected.items():
        assert got[widths] == pytest.approx(value)


def _shapes(out) -> list[str]:
    return [s.shape for s in out.stats.steps]


def test_steep_curve_drafts_nothing_but_probes(tiny_llama64):
    drafter = build_for_tests("small", target=tiny_llama64)
    out = specdec.generate(tiny_llama64, drafter, PROMPT, shape=AutoShape(probe=4, latency=STEEP),
                           max_new_tokens=24, stop_on_eos=False)
    shapes = _shapes(out)
    assert set(shapes) <= {"", "chain(1)"}, shapes  # nothing, or the one-token probe
    assert shapes.count("") >= len(shapes) // 2


def test_flat_curve_drafts_wide_trees(tiny_llama64):
    drafter = build_for_tests("small", target=tiny_llama64)
    out = specdec.generate(tiny_llama64, drafter, PROMPT, shape=AutoShape(max_width=4, latency=FLAT),
                           max_new_tokens=24, stop_on_eos=False)
    trees = [parse_shape(s) for s in _shapes(out) if s.startswith("tree")]
    assert trees and max(t.widths[0] for t in trees) >= 3, _shapes(out)


def test_cpu_like_curve_prefers_chains_to_trees():
    """With acceptance 0.8 at rank 0 and 0.1 beyond, a curve where width costs (CPU-like) picks a
    chain, a flat one a tree."""
    cpu = curve(lambda w: {1: 1.0, 2: 1.4, 4: 1.9, 8: 2.3, 16: 3.0, 32: 4.5, 64: 8.0}[w])
    picks = {}
    for name, lat in (("cpu", cpu), ("flat", FLAT)):
        policy = AutoPolicy(AutoShape(latency=lat))
        policy.trials[:] = 1000
        policy.successes[:] = 100
        policy.successes[:, 0] = 800
        picks[name] = policy.choose(256)
    assert str(picks["cpu"]).startswith("chain"), picks
    assert str(picks["flat"]).startswith("tree"), picks


@pytest.mark.parametrize("name", specdec.drafters.names())
@pytest.mark.parametrize("lat", [FLAT, curve(lambda w: 1.0 + 0.2 * (w - 1))], ids=["flat", "sloped"])
def test_auto_greedy_output_equals_reference(tiny64, name, lat):
    ref = reference_generate(tiny64, PROMPT, max_new_tokens=16, stop_on_eos=False)
    drafter = build_for_tests(name, target=tiny64)
    out = specdec.generate(tiny64, drafter, PROMPT, shape=AutoShape(latency=lat), max_new_tokens=16,
                           stop_on_eos=False)
    assert out.token_ids == ref


def test_estimates_carry_over_to_the_next_generation_of_the_same_drafter(tiny_llama64):
    shape = AutoShape(latency=FLAT)
    drafter = build_for_tests("ngram", target=tiny_llama64)
    first = specdec.auto.shape_policy(shape, tiny_llama64, drafter)
    specdec.generate(tiny_llama64, drafter, PROMPT, shape=shape, max_new_tokens=8, stop_on_eos=False)
    assert first.trials.sum() > 0
    assert specdec.auto.shape_policy(shape, tiny_llama64, drafter) is first
    other = build_for_tests("ngram", target=tiny_llama64)
    assert specdec.auto.shape_policy(shape, tiny_llama64, other).trials.sum() == 0


def test_auto_measures_the_target_curve_once(tiny_llama64, tmp_path, monkeypatch):
    """Without a given curve, auto measures the target's latency once and reads it back after."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    specdec.generate(tiny_llama64, None, PROMPT, shape="auto(max_nodes=6)", max_new_tokens=2)
    saved = list((tmp_path / "latency").glob("*.json"))
    assert len(saved) == 1
    before = saved[0].stat().st_mtime_ns
    out = specdec.generate(tiny_llama64, None, PROMPT, shape="auto(max_nodes=6)", max_new_tokens=4,
                           stop_on_eos=False)
    assert saved[0].stat().st_mtime_ns == before and len(out.token_ids) == 4
    assert np.isfinite(out.stats.mean_acceptance_length)
