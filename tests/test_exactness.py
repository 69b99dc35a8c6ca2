"""Exactness of the one loop, for every registered drafter.

- T = 0: speculative output == the cacheless reference's greedy output, token for token, for every
  drafter x shape x model family (fp64 tiny models), plus a drafter that is always right;
- T > 0: chi-square goodness of fit of the joint distribution of the first three generated tokens
  against the exact target distribution, for every drafter x chain / static tree / dynamic tree x
  {plain, top-k, top-p} x {EOS stopping off, on} (every draft checked by the certificate's
  `Recorder`: draft_probs well formed and matching the sampled tokens), for sampled siblings with
  draft probabilities; and the certificate's reference cases catch every mutant of the real
  acceptance code and draft sampler (`specdec.certify.mutants`), while passing unmutated.
The exact law of one verification step, without sampling noise, is tests/test_exact_law.py.
"""

import pytest
import torch
import specdec
from specdec import certify
from specdec.drafters import Draft, build, build_for_tests
from specdec.loop.reference import reference_generate
from specdec.certify.mutants import MUTANTS, mutated

PROMPTS = certify.GREEDY_PROMPTS

# ---- T = 0 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", specdec.drafters.names())
@pytest.mark.parametrize("shape", certify.GREEDY_SHAPES)
def test_greedy_output_equals_reference(tiny64, name, shape):
    divergence = certify.greedy_case(tiny64, build_for_tests(name, target=tiny64), shape)
    assert divergence is None, f"{name} diverged from greedy: {divergence}"


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
# The harness is specdec.certify's (the `python -m specdec.certify` command runs the same functions):
# N_SAMPLES seeded generations per case, the first certify.LENGTH = 3 tokens of each compared with the
# exact joint law (vocabulary 5, enumerated with the reference; with EOS stopping on, the law cut
# after the first EOS, an EOS token picked so that about half the generations stop early) by
# Pearson's chi-square, cells binned by the law so each bin expects >= 5; a case passes when
# p >= ALPHA = 1e-4 (8 drafters x 3 shapes x 3 samplings x 2 = 144 cases: a false alarm somewhere has
# probability < 1.5e-2, and the seeds are fixed, so the outcome is deterministic). N = 80 per case
# (what fits the suite's time) catches only gross errors; the subtle wrong rules are shown caught
# on the certificate's reference cases below, each mutant edited into the real code.
N_SAMPLES = 80
POWER_SAMPLES = 400
"""Generations per reference case here (the certificate runs certify.POWER_N)."""


@pytest.fixture(scope="module")
def world():
    return certify.tiny_world()


@pytest.mark.parametrize("eos", [False, True], ids=["eos-off", "eos-on"])
@pytest.mark.parametrize("sampling", list(certify.SAMPLINGS))
@pytest.mark.parametrize("shape", certify.DISTRIBUTION_SHAPES, ids=["chain", "tree", "dynamic"])
@pytest.mark.parametrize("name", specdec.drafters.names())
def test_sampling_matches_the_target_distribution(world, name, shape, sampling, eos):
    drafter = certify.build_drafter(name, world.target)
    case = certify.distribution_case(world.target, drafter, shape, sampling, N_SAMPLES, eos)
    assert case.problem is None, f"{name} {shape} {sampling} eos={eos}: {case.problem}"
    assert case.p_value >= certify.ALPHA, f"{name} {shape} {sampling} eos={eos}: chi-square p = {case.p_value:.2e}"
    assert case.draft_p is None or case.draft_p >= certify.ALPHA, f"draft tokens vs draft_probs: p = {case.draft_p:.2e}"


@pytest.mark.parametrize("replace", [True, False], ids=["iid", "without-replacement"])
def test_sibling_draft_probabilities_are_exact(world, replace):
    """Sampled siblings that carry draft probabilities (the conditional one given the earlier
    siblings when drawn without replacement): no grower makes them yet, the verifier supports them."""
    drafter = certify.SiblingDrafter(certify.VOCAB, width=2, depth=2, replace=replace, like=world.draft_model,
                                     sharpen=2.0, noise=0.5)
    case = certify.distribution_case(world.target, drafter, "tree(2,2)", "plain", 300)
    assert case.rejections > case.steps / 5, "the case should exercise rejections"
    assert case.p_value >= certify.ALPHA and case.draft_p >= certify.ALPHA, (case.p_value, case.draft_p)


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_the_reference_cases_catch_each_mutant_of_the_real_code(world, m):
    with mutated(m):
        cases = certify.reference_cases(world, POWER_SAMPLES, names=(m.case,))
    p = min(c.min_p for c in cases)
    assert p <= certify.POWER_ALPHA, f"{m.name} went undetected (p = {p:.2e}): {m.why}"


def test_the_reference_cases_pass_unmutated(world):
    """The control of the power section: the same cases with the real code pass, and they reject."""
    cases = certify.reference_cases(world, POWER_SAMPLES)
    assert all(c.problem is None and c.min_p >= certify.ALPHA for c in cases), [(c.label, c.min_p) for c in cases]
    sampled = [c for c in cases if c.sampling != "greedy"]  # the greedy case rejects by the argmax only
    assert all(c.rejections > c.steps / 5 for c in sampled), [(c.label, c.rejections, c.steps) for c in sampled]
    assert len(sampled) == len(cases) - 1


def test_same_seed_reproduces_and_other_seeds_differ(tiny_llama64):
    drafter = build("small", target=tiny_llama64)
    runs = [specdec.generate(tiny_llama64, drafter, PROMPTS[0], shape="tree(2,2)", max_new_tokens=16,
                             temperature=1.0, seed=s, stop_on_eos=False).token_ids for s in (0, 0, 1)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
