"""`shape="auto"`: parsing and bad options, the estimator's arithmetic, the shapes it picks under a
steep and a flat (synthetic) latency curve, trimming (what it keeps, why sampled drafts are left
whole, how trimmed nodes still calibrate, cheap drafters), and exactness for every drafter."""

import numpy as np
import pytest
import torch

import specdec
import specdec.loop.policy
from specdec.loop.auto_policy import AutoPolicy, candidate_widths
from specdec.loop.policy import shape_policy
from specdec.drafters import build_for_tests
from specdec.core.curve import LatencyCurve
from specdec.loop.reference import reference_generate
from specdec.runtime.cache import KVCache
from specdec.core.draft import Acceptance, Draft, DraftRequest
from specdec.core.events import PhaseTimes, StepEvent

from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import AutoShape, ChainShape, TreeShape, parse_shape
from specdec.core.acceptance import acceptance_probability, residual_probs

PROMPT = [3, 5, 7, 3, 5, 7, 3, 5, 9, 3, 5]
WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def curve(seconds_per_width) -> LatencyCurve:
    return LatencyCurve(target="synthetic", device="cpu", dtype="float64", machine="test", threads=1,
                        widths=WIDTHS, contexts=(256,), seconds=(tuple(seconds_per_width(w) for w in WIDTHS),))


STEEP = curve(lambda w: 1.0 * w)  # every extra token costs a whole forward: drafting never pays
FLAT = curve(lambda w: 1.0)  # width is free: the widest tree pays
CPU_LIKE = curve(lambda w: {1: 1.0, 2: 1.4, 4: 1.9, 8: 2.3, 16: 3.0, 32: 4.5, 64: 8.0}[w])  # width costs, as on a CPU


def test_auto_parses_and_bad_options_fail_before_generation(tiny_llama64):
    assert parse_shape("auto") == AutoShape()
    assert parse_shape("auto(max_depth=3,max_width=2)") == AutoShape(max_depth=3, max_width=2)
    assert parse_shape("auto(explore=0)") == AutoShape(explore=0) and str(AutoShape(explore=2)).endswith(",explore=2)")
    for bad, match in [("auto(depth=3)", "unknown: depth"), ("auto(3)", "keyword options"),
                       ("auto(max_nodes=0)", "max_nodes"), ("auto(explore=-1)", "explore")]:
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
    policy.successes[:] = [[1, 2], [0, 0]]  # s = (succ + 1) / (trials + 4) at depth 1, the Beta(1, 3) prior
    policy.trials[:] = [[2, 2], [2, 2]]
    a, b = 1 / 3, 1 / 2  # depth 2: the same prior weight (4) centred on depth 1's estimates
    c, d = (0 + 4 * a) / (2 + 4), (0 + 4 * b) / (2 + 4)
    q1_2, q2_2 = 1 - (1 - a) * (1 - b), 1 - (1 - c) * (1 - d)
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
    steps = out.stats.steps
    # nothing verified but the one-token probes (a cheap drafter may be asked, then trimmed to nothing)
    assert all(s.drafted == 0 or s.shape == "chain(1)" for s in steps), [(s.shape, s.drafted) for s in steps]
    assert sum(s.drafted == 0 for s in steps) >= len(steps) // 2


def test_flat_curve_drafts_wide_trees(tiny_llama64):
    drafter = build_for_tests("small", target=tiny_llama64)
    out = specdec.generate(tiny_llama64, drafter, PROMPT, shape=AutoShape(max_width=4, latency=FLAT),
                           max_new_tokens=24, stop_on_eos=False)
    trees = [parse_shape(s) for s in _shapes(out) if s.startswith("tree")]
    assert trees and max(t.widths[0] for t in trees) >= 3, _shapes(out)


def test_cpu_like_curve_prefers_chains_to_trees():
    """With acceptance 0.8 at rank 0 and 0.1 beyond, a curve where width costs (CPU-like) picks a
    chain, a flat one a tree."""
    picks = {}
    for name, lat in (("cpu", CPU_LIKE), ("flat", FLAT)):
        policy = AutoPolicy(AutoShape(latency=lat))
        policy.trials[:] = 1000
        policy.successes[:] = 100
        policy.successes[:, 0] = 800
        picks[name] = policy.choose(256)
    assert str(picks["cpu"]).startswith("chain"), picks
    assert str(picks["flat"]).startswith("tree"), picks


@pytest.mark.parametrize("name", specdec.drafters.names())
@pytest.mark.parametrize("lat", [FLAT, curve(lambda w: 1.0 + 0.2 * (w - 1)), STEEP], ids=["flat", "sloped", "steep"])
def test_auto_greedy_output_equals_reference(tiny64, name, lat):
    """Steep: most steps ask for no draft (the drafter hears only `commit`), probes draft one token."""
    ref = reference_generate(tiny64, PROMPT, max_new_tokens=16, stop_on_eos=False)
    drafter = build_for_tests(name, target=tiny64)
    out = specdec.generate(tiny64, drafter, PROMPT, shape=AutoShape(latency=lat), max_new_tokens=16,
                           stop_on_eos=False)
    assert out.token_ids == ref


def test_estimates_carry_over_to_the_next_generation_of_the_same_drafter(tiny_llama64):
    shape = AutoShape(latency=FLAT)
    drafter = build_for_tests("ngram", target=tiny_llama64)
    first = specdec.loop.policy.shape_policy(shape, tiny_llama64, drafter)
    specdec.generate(tiny_llama64, drafter, PROMPT, shape=shape, max_new_tokens=8, stop_on_eos=False)
    assert first.trials.sum() > 0
    assert specdec.loop.policy.shape_policy(shape, tiny_llama64, drafter) is first
    other = build_for_tests("ngram", target=tiny_llama64)
    assert specdec.loop.policy.shape_policy(shape, tiny_llama64, other).trials.sum() == 0


def test_auto_plans_with_the_tuned_curve_else_the_untuned_default(tiny_llama64, tmp_path, monkeypatch):
    """Without a given curve, auto reads the curve `specdec.tune` stored, else the documented default;
    it never measures (nothing is written)."""
    from specdec.loop.tuned import DEFAULT_WIDTH_COST
    from specdec.measure import latency

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    drafter = build_for_tests("ngram", target=tiny_llama64)
    policy = shape_policy(parse_shape("auto(max_nodes=6)"), tiny_llama64, object())
    assert policy.curve.machine == "not tuned"
    assert policy.curve.ratio(9) == pytest.approx(1 + 8 * DEFAULT_WIDTH_COST)
    out = specdec.generate(tiny_llama64, drafter, PROMPT, shape="auto(max_nodes=6)", max_new_tokens=4,
                           stop_on_eos=False)
    assert len(out.token_ids) == 4 and not any(tmp_path.iterdir())
    stored = latency.cached_latency(tiny_llama64, widths=(1, 2, 4, 8), contexts=(8,), repeats=1)
    tuned = shape_policy(parse_shape("auto(max_nodes=6)"), tiny_llama64, object()).curve
    assert tuned == stored and tuned.machine != "not tuned"


# ---- trimming: verify only the part of a scored draft that pays ------------------------------------
SLOPED = curve(lambda w: 1.0 + 0.3 * (w - 1))  # every extra verified token costs 0.3 of a step


def scored(confidences, parents, probs=None) -> Draft:
    """A point-mass draft whose node i has confidence confidences[i] given its parent."""
    own = torch.tensor(confidences, dtype=torch.float64).log()
    scores = own.clone()
    for i, parent in enumerate(parents):
        if parent >= 0:
            scores[i] += scores[parent]
    return Draft(torch.arange(10, 10 + len(parents))[None], torch.tensor(parents), probs, scores=scores)


def event(shape, proposal: Draft, acceptance: Acceptance, keep=None, *, forward: float = 1.0, propose: float = 0.0,
          commit: float = 0.0, context: int = 256) -> StepEvent:
    """The event of one step of batch row 0 that ends with `context` tokens committed."""
    draft = proposal if keep is None else proposal.subtree(keep)
    new = len(acceptance.path) + 1
    return StepEvent(index=0, rows=[0], shape=shape, proposals=[proposal], drafts=[draft], kept=[keep],
                     acceptances=[acceptance], paths=[acceptance.path], committed=[[0] * new], done=[False],
                     logits=torch.zeros(1, 1, 1), contexts=[context - new], width=1 + draft.num_nodes,
                     times=PhaseTimes(choose=0.0, propose=propose, forward=forward, accept=0.0, commit=commit),
                     start_s=0.0)


def test_trim_keeps_the_ancestor_closed_subtree_with_the_best_value():
    """Calibration starts at the drafter's own confidence (bin centres 0.95 and 0.15), so the expected
    acceptances along the paths are P = [0.95, 0.95^2, 0.95^2 * 0.15, 0.15]; under SLOPED,
    (1 + sum of the k best P) / (1 + 0.3 k) peaks at k = 2: nodes 0 and 1."""
    draft = scored([0.95, 0.95, 0.15, 0.15], [-1, 0, 1, -1])
    kept = draft.subtree(AutoPolicy(AutoShape(latency=SLOPED)).keep(draft, 256))
    assert kept.node_ids.tolist() == [0, 1] and kept.tokens.tolist() == [[10, 11]]
    assert AutoPolicy(AutoShape(latency=FLAT)).keep(draft, 256) is None  # width is free: verify all
    assert AutoPolicy(AutoShape(latency=STEEP)).keep(draft, 256).numel() == 0  # nothing pays
    assert AutoPolicy(AutoShape(trim=0, latency=STEEP)).keep(draft, 256) is None  # trimming off
    assert str(parse_shape("auto(trim=0)")) == "auto(max_depth=8,max_width=4,max_nodes=32,trim=0)"
    with pytest.raises(ValueError, match="trim"):
        parse_shape("auto(trim=2)")


def test_sampled_drafts_are_never_trimmed_because_that_would_bias_the_output():
    """A sampled node dropped for its own token's draft probability changes the law of the step: for
    a one-node draft x ~ q verified only when q(x) is above the median, P(token) != target. The same
    step verifying x always (or never) has the target's law. trim() leaves sampled drafts whole."""
    g = torch.Generator().manual_seed(0)
    p, q = (torch.randn(6, generator=g, dtype=torch.float64) * 2).softmax(-1), \
        (torch.randn(6, generator=g, dtype=torch.float64) * 2).softmax(-1)

    def law(verified):  # P(committed token) for x ~ q, verified when verified(x), else a plain step
        out = torch.zeros(6, dtype=torch.float64)
        for x in range(6):
            if verified(x):
                a = acceptance_probability(p[x], q[x])
                out[x] += q[x] * a
                out += q[x] * (1 - a) * residual_probs(p, q)
            else:
                out += q[x] * p
        return out

    assert torch.allclose(law(lambda x: True), p, atol=1e-12)
    assert torch.allclose(law(lambda x: False), p, atol=1e-12)
    assert not torch.allclose(law(lambda x: bool(q[x] > q.median())), p, atol=1e-3)
    sampled = scored([0.5, 0.5], [-1, 0], probs=torch.full((1, 2, 6), 1 / 6))
    assert AutoPolicy(AutoShape(latency=STEEP)).keep(sampled, 256) is None


def test_trimmed_children_of_the_last_accepted_node_still_calibrate():
    """Two root children trimmed away; the step ends on a bonus token equal to the second child's:
    both count as trials of their cells, the second as a success."""
    policy = AutoPolicy(AutoShape(latency=STEEP))
    draft = scored([0.35, 0.65], [-1, -1])
    keep = policy.keep(draft, 256)
    assert keep.numel() == 0
    policy.observe(event(TreeShape((2,)), draft, Acceptance(path=[], next_token=11, bonus=True), keep), 0)
    assert policy.calib_trials[0, 3] == 1 and policy.calib_successes[0, 3] == 0  # confidence 0.35: bin 3
    assert policy.calib_trials[0, 6] == 1 and policy.calib_successes[0, 6] == 1  # 0.65: bin 6, token 11
    assert policy.kept[0, :2].tolist() == [0, 0] and policy.asked[0, :2].tolist() == [1, 1]  # ranks 0, 1: dropped


def test_a_cheap_drafter_is_asked_for_the_deepest_shape_even_when_drafting_looks_worthless():
    policy = AutoPolicy(AutoShape(max_depth=3, max_width=2, max_nodes=8, latency=SLOPED))
    policy.trials[:] = 1000  # acceptance ~0: the model alone says "draft nothing"
    policy.trims = True
    policy.draft_cost, policy.recent_draft_cost = {1: 1e-4}, 1e-4  # under 3% of a one-token step (1 s)
    shape = policy.choose(256)
    assert shape is not None and len(getattr(shape, "widths", (1,) * getattr(shape, "k", 0))) == 3, shape
    policy.draft_cost, policy.recent_draft_cost = {1: 0.5}, 0.5  # an expensive drafter is not asked
    policy.idle_steps = -100  # (no probe either)
    assert policy.choose(256) is None


def test_growers_and_ngram_record_path_confidences(tiny_llama64):
    """Chains and static trees record cumulative draft log-probabilities (each node's own is the
    log-softmax of its token); n-gram lookup ranks a long match above a short one."""
    drafter = build_for_tests("small", target=tiny_llama64)
    for shape in ("chain(3)", "tree(2,2)"):
        drafter.reset()
        drafter.commit(specdec.loop.decode.prefill(tiny_llama64, KVCache(), PROMPT))
        draft = drafter.propose(DraftRequest(token_ids=torch.tensor([PROMPT]), shape=parse_shape(shape),
                                             sampling=SamplingConfig(), generator=torch.Generator(), max_depth=8))
        parents = draft.parents.tolist()
        own = [float(draft.scores[i] - (draft.scores[p] if p >= 0 else 0)) for i, p in enumerate(parents)]
        assert all(x <= 1e-6 for x in own) and any(x < -1e-3 for x in own), own
    ngram = build_for_tests("ngram", target=tiny_llama64)

    def first_confidence(ids):
        d = ngram.propose(DraftRequest(token_ids=torch.tensor([ids]), shape=parse_shape("chain(2)"),
                                       sampling=SamplingConfig(), generator=torch.Generator(), max_depth=8))
        return float(d.scores[0].exp())

    # "1 2 3", "2 3" and "3" all seen before "4": weight 3 + 2 + 1 of that + 1; only "3": 1 of 1 + 1
    long_match = first_confidence([1, 2, 3, 4, 9, 1, 2, 3])
    short_match = first_confidence([5, 6, 3, 4, 9, 1, 2, 3])
    assert long_match == pytest.approx(6 / 7) and short_match == pytest.approx(1 / 2)


def test_trimming_survival_is_counted_per_sibling_rank():
    """The worked example of `_count_survivors`: tree(2,1) asked, proposal [a, b, a1, b1], a and a1
    verified. A chain is then not charged for trimmed second siblings: chain(1)'s expected
    acceptance uses rank 0's survival only."""
    policy = AutoPolicy(AutoShape(latency=STEEP))
    policy.trims = True
    proposal = scored([0.9, 0.2, 0.8, 0.7], [-1, -1, 0, 1])
    for _ in range(8):
        policy._count_survivors(proposal, np.array([0, 2]), (2, 1), [0])  # a accepted
    assert policy.asked[:2, :2].tolist() == [[8, 8], [8, 0]]
    assert policy.kept[:2, :2].tolist() == [[8, 0], [8, 0]]
    assert policy.asked_path[:2, :2].tolist() == [[8, 8], [8, 0]]  # the root and a: both on the path
    assert policy.kept_path[:2, :2].tolist() == [[8, 0], [8, 0]]
    survival = policy.survival()
    assert survival[0, 0] == 1.0 and survival[0, 1] == 4 / 12  # prior: 4 of 4 kept
    chain1 = policy.widths.index((1,))
    assert policy.expected_accepted()[chain1] == pytest.approx(policy.acceptance()[0, 0])
    assert policy.expected_verified()[chain1] == pytest.approx(1.0)


def test_acceptance_reads_the_survival_of_accepted_parents_children():
    """tree(3,1) asked, proposal [a, b, c, a1, b1, c1]: trimming keeps a, b, c and a1 (the children
    of the unlikely b and c are cut) and a, a1 are accepted, every step. Over all verified parents
    depth 2 looks kept one time in three (v), but the accepted parent's child is always kept (u):
    a chain's expected acceptance must read u, else deeper shapes look two-thirds dropped and are
    never tried (what auto did on the embedded target in bf16)."""
    policy = AutoPolicy(AutoShape(latency=STEEP))
    policy.trims = True
    policy.trials[:2, 0], policy.successes[:2, 0] = 1000, 800  # s[1, 0] = s[2, 0] ~ 0.8
    proposal = scored([0.9, 0.1, 0.1, 0.9, 0.9, 0.9], [-1, -1, -1, 0, 1, 2])
    for _ in range(60):
        policy._count_survivors(proposal, np.array([0, 1, 2, 3]), (3, 1), [0, 3])
    v, u = policy.survival(), policy.survival(on_path=True)
    assert v[1, 0] == pytest.approx((60 + 4) / (180 + 4))  # prior: 4 of 4 kept
    assert u[1, 0] == pytest.approx((60 + 4 * v[1, 0]) / (60 + 4)) and u[1, 0] > 0.95  # prior: v, weight 4
    chain2 = policy.widths.index((1, 1))
    s = policy.acceptance()
    assert policy.expected_accepted()[chain2] == pytest.approx(s[0, 0] + s[0, 0] * s[1, 0] * u[1, 0])
    assert policy.expected_accepted()[chain2] > s[0, 0] + s[0, 0] * s[1, 0] * v[1, 0] + 0.3
    # the verification width still counts every verified parent's children: tree(3,1) ~ 3 + 3 v[1, 0]
    assert policy.expected_verified()[policy.widths.index((3, 1))] == pytest.approx(
        v[0, :3].sum() * (1 + v[1, 0]))


def test_a_dip_in_the_measured_curve_is_read_as_flat():
    """Four tokens measured cheaper than two (noise, or a kernel's blocking): the policy reads the
    curve as non-decreasing, so trimming does not cut every draft to the dip's width."""
    dip = curve(lambda w: {1: 1.0, 2: 1.3, 4: 1.1, 8: 2.0, 16: 3.0, 32: 4.5, 64: 8.0}[w])
    row = AutoPolicy(AutoShape(latency=dip))._latency_row(256, 8)
    assert (np.diff(row) >= 0).all() and row[0] == 1.0 and row[1] == pytest.approx(1.3)
    assert row[3] == pytest.approx(1.3) and row[7] == pytest.approx(2.0)  # widths 4 and 8


def _simulate(policy: AutoPolicy, accept, steps: int, seed: int = 0) -> list[str]:
    """Run `policy` for `steps` steps against a synthetic chain drafter whose depth-d node is accepted
    with probability accept(d) (given its parent was); the target's time is the curve's own, so the
    load scale stays 1. Returns the shapes chosen."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(steps):
        shape = policy.choose(256)
        chosen.append(str(shape))
        depth = 0 if shape is None else len(getattr(shape, "widths", ())) or shape.k
        draft = Draft(torch.arange(10, 10 + depth)[None], torch.arange(-1, depth - 1))
        keep = policy.keep(draft, 256)
        path = []
        while len(path) < depth and rng.random() < accept(len(path) + 1):
            path.append(len(path))
        policy.observe(event(shape, draft, Acceptance(path=path, next_token=0, bonus=True), keep,
                             forward=policy.curve.at(1 + depth, 256), propose=0.001 * depth), 0)
    return chosen


def test_probes_that_leave_no_draft_the_best_come_ever_more_rarely():
    """Width costs a whole forward per token (drafting never pays) while every probe is accepted: each probe
    leaves "no draft" the best, so the interval (a probe is its last step) doubles from 4 to at most 64 and
    carries into the next generation. Resetting after every accepted probe drafted chain(1) every 5th step,
    whose drafting made `auto` slower than plain decoding on a fast target."""
    policy = AutoPolicy(AutoShape(max_depth=2, max_width=1, max_nodes=2, probe=4, latency=STEEP))
    chosen = _simulate(policy, lambda d: 1.0, 260)
    probes = [i for i, shape in enumerate(chosen) if shape != "None"]
    assert all(chosen[i] == "chain(1)" for i in probes)
    assert probes[0] == 3 and [b - a for a, b in zip(probes, probes[1:])] == [8, 16, 32, 64, 64, 64], probes
    policy.start()  # a new generation keeps the schedule: 259 - probes[-1] of the 64 steps are behind it
    assert _simulate(policy, lambda d: 1.0, 64).index("chain(1)") == 64 - (259 - probes[-1]) - 1


@pytest.mark.parametrize("explore", [0, 1])
def test_an_early_pessimistic_estimate_is_corrected_by_optimism(explore):
    """Depth 1 is well known (0.8 of 1000); depth 2 got 0 of 4 early (mean 0.4 under its prior),
    while the drafter's true depth-2 acceptance is 0.8. Without optimism (explore=0) chain(1) wins
    and depth 2 never gets another trial, so the estimate is never corrected: the lock-in `auto` hit
    on the embedded target (MAL 1.46 where chain(4) reached 1.92). With it, deeper chains are tried
    and kept."""
    policy = AutoPolicy(AutoShape(max_depth=4, max_width=1, max_nodes=4, explore=explore, latency=CPU_LIKE))
    policy.trials[0, 0], policy.successes[0, 0], policy.trials[1, 0] = 1000, 800, 4
    chosen = _simulate(policy, lambda d: 0.8, 200)
    if explore:
        assert chosen[-1] in ("chain(3)", "chain(4)") and policy.trials[1, 0] > 100, chosen[-20:]
        assert policy.acceptance()[1, 0] == pytest.approx(0.8, abs=0.1)
    else:
        assert set(chosen) == {"chain(1)"} and policy.trials[1, 0] == 4


def test_optimism_fades_when_depth_two_is_truly_poor():
    """The same start, but the drafter's depth-2 acceptance really is 0.05: after its trials, auto
    returns to chain(1) for good."""
    policy = AutoPolicy(AutoShape(max_depth=4, max_width=1, max_nodes=4, latency=CPU_LIKE))
    policy.trials[0, 0], policy.successes[0, 0], policy.trials[1, 0] = 1000, 800, 4
    chosen = _simulate(policy, lambda d: 0.8 if d == 1 else 0.05, 300)
    assert set(chosen[-100:]) == {"chain(1)"} and "chain(2)" in chosen, chosen[:20]


def test_commit_time_is_charged_to_every_option_and_not_per_depth():
    """A drafter whose commit (5 ms, paid every step) dwarfs its propose (1 ms per depth): an unseen
    depth 4 is estimated at 4 ms of proposing, not 4 x 6 ms, and "no draft" pays the commit too."""
    policy = AutoPolicy(AutoShape(max_depth=4, max_width=1, max_nodes=4, latency=CPU_LIKE))
    draft = Draft(torch.tensor([[10]]), torch.tensor([-1]))
    for _ in range(3):
        keep = policy.keep(draft, 256)
        policy.observe(event(ChainShape(1), draft, Acceptance(path=[0], next_token=0, bonus=True), keep,
                             forward=1.4, propose=0.001, commit=0.005), 0)
    assert policy._draft_seconds(4) == pytest.approx(0.004)
    assert policy.commit_cost == pytest.approx(0.005 * (1 - 0.7 ** 3))  # EMA from 0, weight 0.3
    _, none = policy.values(256)
    assert none == pytest.approx(1 / (1.0 + policy.commit_cost))


def test_the_loop_records_the_drafters_commit_time(tiny_llama64):
    drafter = build_for_tests("small", target=tiny_llama64)
    out = specdec.generate(tiny_llama64, drafter, PROMPT, shape="chain(2)", max_new_tokens=6, stop_on_eos=False)
    assert all(0 < s.commit_time_s <= s.draft_time_s for s in out.stats.steps)
