"""Exactness of the one loop, for every registered drafter.

- T = 0: speculative output == the cacheless reference's greedy output, token for token, for every
  drafter x shape x model family (fp64 tiny models), plus a drafter that is always right;
- T > 0: chi-square goodness of fit of the joint distribution of the first three generated tokens
  against the exact target distribution (enumerated with the reference), for a chain with draft
  probabilities, a tree of point-mass siblings, garbage point-mass drafts, and top-k/top-p targets;
  and the same test rejects a deliberately wrong acceptance rule (so it has power).
"""

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

import specdec
from specdec import verifier
from specdec.drafters import Draft, build, build_for_tests
from specdec.reference import exact_joint_probs, reference_generate
from specdec.sampling import SamplingConfig

SHAPES = ["chain(1)", "chain(4)", "tree(3,2,2)", "dynamic(top_k=3,depth=5,budget=12)"]
PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 13], [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 2, 3, 5]]

# ---- T = 0 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", specdec.drafters.names())
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_output_equals_reference(tiny64, name, shape):
    drafter = build_for_tests(name, target=tiny64)
    for prompt in PROMPTS:
        ref = reference_generate(tiny64, prompt, max_new_tokens=20, stop_on_eos=False)
        out = specdec.generate(tiny64, drafter, prompt, shape=shape, max_new_tokens=20, stop_on_eos=False)
        assert out.token_ids == ref, f"{name} {shape} diverged from greedy on prompt {prompt}"


class OracleDrafter:
    """Test-only drafter that knows the greedy continuation: each level holds a wrong sibling
    first and the right token second (a chain gets the right token only)."""

    name = "oracle"

    def __init__(self, truth: list[int], vocab: int, tree: bool):
        self.truth, self.vocab, self.tree = truth, vocab, tree

    def reset(self):
        pass

    def propose(self, request):
        done = request.token_ids.shape[1]
        right = self.truth[done : done + min(4, request.max_depth)]
        tokens, parents, parent = [], [], -1
        for tok in right:
            if self.tree:
                tokens.append((tok + 1) % self.vocab)
                parents.append(parent)
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
        if not tokens:
            return Draft.empty()
        return Draft(torch.tensor([tokens]), torch.tensor(parents))

    def commit(self, step):
        pass


@pytest.mark.parametrize("tree", [False, True])
def test_always_right_drafts_are_accepted_and_exact(tiny_llama64, tree):
    prompt = PROMPTS[0]
    ref = reference_generate(tiny_llama64, prompt, max_new_tokens=24, stop_on_eos=False)
    oracle = OracleDrafter(prompt + ref, tiny_llama64.vocab_size, tree)
    out = specdec.generate(tiny_llama64, oracle, prompt, max_new_tokens=24, stop_on_eos=False)
    assert out.token_ids == ref
    # 24 tokens in steps of 4 accepted + 1 bonus: 5 steps, the last one cut short by the length.
    assert out.stats.num_steps == 5
    assert out.stats.mean_acceptance_length == pytest.approx(24 / 5)
    assert all(s.bonus for s in out.stats.steps)


def test_plain_loop_is_the_none_drafter(tiny_llama64):
    out = specdec.generate(tiny_llama64, None, PROMPTS[1], max_new_tokens=12, stop_on_eos=False)
    assert out.stats.mean_acceptance_length == 1.0 and out.stats.num_steps == 12
    assert out.token_ids == reference_generate(tiny_llama64, PROMPTS[1], max_new_tokens=12, stop_on_eos=False)


def test_generation_stops_on_eos_inclusive(tiny_llama64):
    prompt = PROMPTS[0]
    ref = reference_generate(tiny_llama64, prompt, max_new_tokens=10, stop_on_eos=False)
    tiny_llama64.model.generation_config.eos_token_id = ref[3]
    try:
        out = specdec.generate(tiny_llama64, build("ngram", target=tiny_llama64), prompt, max_new_tokens=10)
        assert out.token_ids == ref[: ref.index(ref[3]) + 1]
    finally:
        tiny_llama64.model.generation_config.eos_token_id = None


# ---- T > 0 ---------------------------------------------------------------------------------------
# Sample size and significance: N_SAMPLES generations per case, the first LENGTH tokens of each
# compared with the exact joint distribution by Pearson's chi-square, cells with expected count < 5
# pooled into one; a case passes when p >= ALPHA. Seeds are fixed, so the outcome is deterministic.
# At this N the wrong rule below is rejected with p < 1e-13 in every case, so a small ALPHA costs
# no power while keeping the chance of a false alarm over all cases below 1e-3.
N_SAMPLES = 2000
LENGTH = 3
ALPHA = 1e-4
VOCAB = 5


@pytest.fixture(scope="module")
def small_world():
    """A tiny target with a 5-token vocabulary and a different tiny model as its draft model."""
    target = specdec.tiny_target("llama", vocab_size=VOCAB, hidden_size=16, dtype=torch.float64, seed=0,
                                 logit_scale=6.0)
    draft_model = specdec.tiny_target("llama", vocab_size=VOCAB, hidden_size=16, dtype=torch.float64, seed=7,
                                      logit_scale=6.0)
    return target, draft_model


def sample_p_value(target, drafter, shape, sampling: SamplingConfig, prompt=(1, 2, 3)) -> float:
    counts = Counter()
    for seed in range(N_SAMPLES):
        out = specdec.generate(target, drafter, list(prompt), shape=shape, max_new_tokens=LENGTH,
                               temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                               seed=seed, stop_on_eos=False)
        counts[tuple(out.token_ids)] += 1
    exact = exact_joint_probs(target, list(prompt), LENGTH, sampling)
    assert set(counts) <= set(exact), "sampled a sequence the target gives zero probability"
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * N_SAMPLES >= 5]
    small = [c for c in cells if exact[c] * N_SAMPLES < 5]
    observed = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    expected = [exact[c] * N_SAMPLES for c in big] + ([sum(exact[c] for c in small) * N_SAMPLES] if small else [])
    return float(chisquare(observed, expected).pvalue)


CASES = {
    "chain with draft probabilities": ("small", "chain(2)", SamplingConfig(temperature=1.0)),
    "tree of point-mass siblings": ("small", "tree(2,2)", SamplingConfig(temperature=1.0)),
    "garbage point-mass tree": ("random", "tree(2,1)", SamplingConfig(temperature=1.0)),
    "chain, top-k and top-p target": ("small", "chain(2)", SamplingConfig(temperature=0.8, top_k=3, top_p=0.9)),
}


def _drafter(name, target, draft_model):
    return build("small", target=target, model=draft_model) if name == "small" else build(name, target=target)


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_matches_the_target_distribution(small_world, case):
    target, draft_model = small_world
    name, shape, sampling = CASES[case]
    p = sample_p_value(target, _drafter(name, target, draft_model), shape, sampling)
    assert p >= ALPHA, f"{case}: chi-square p = {p:.2e} < {ALPHA}"


@pytest.mark.parametrize("case", ["chain with draft probabilities", "tree of point-mass siblings",
                                  "garbage point-mass tree"])
def test_chi_square_rejects_a_wrong_acceptance_rule(small_world, case, monkeypatch):
    """The classic bug: after a rejection, resample from the target instead of the residual."""
    target, draft_model = small_world
    name, shape, sampling = CASES[case]
    monkeypatch.setattr(verifier, "residual_probs", lambda target_probs, draft_probs: target_probs)
    p = sample_p_value(target, _drafter(name, target, draft_model), shape, sampling)
    assert p < ALPHA, f"{case}: the wrong rule went undetected (p = {p:.3f})"


def test_same_seed_reproduces_and_other_seeds_differ(tiny_llama64):
    drafter = build("small", target=tiny_llama64)
    runs = [specdec.generate(tiny_llama64, drafter, PROMPTS[0], shape="tree(2,2)", max_new_tokens=16,
                             temperature=1.0, seed=s, stop_on_eos=False).token_ids for s in (0, 0, 1)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
