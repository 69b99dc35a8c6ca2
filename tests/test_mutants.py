"""The certificate's mutants edit the real code: each applies, changes what runs, and is undone.

The power of the reference cases against every mutant (p <= 1e-6) is test_exactness.py's; the
mutants' effect on the exact one-step law (no sampling noise) is test_exact_law.py's."""

import pytest
import torch

import specdec
from specdec.core import acceptance, grow, shapes
from specdec.core.draft import Draft
from specdec.core.sampling import SamplingConfig
from specdec.measure.mutants import MUTANTS, Mutant, MutantDoesNotApply, mutant, mutated


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_and_is_undone(m):
    function = getattr(__import__(m.module, fromlist=[m.function]), m.function)
    code = function.__code__
    with mutated(m):
        edited = function.__code__
        assert (edited.co_code, edited.co_names, edited.co_consts) != (code.co_code, code.co_names, code.co_consts)
        assert edited.co_firstlineno == code.co_firstlineno  # tracebacks point at the real lines
    assert function.__code__ is code


def test_a_mutant_that_no_longer_matches_says_which():
    stale = Mutant("stale", "specdec.core.acceptance", "residual_probs", "no such text", "x", "test")
    with pytest.raises(MutantDoesNotApply, match="stale.*residual_probs"):
        with mutated(stale):
            pass
    with pytest.raises(KeyError, match="unknown mutant 'nope'"):
        mutant("nope")


def test_residual_mutant_changes_the_real_function():
    target, draft = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([1.0, 0.0, 0.0])
    assert acceptance.residual_probs(target, draft).sum() == pytest.approx(1.0)
    with mutated(mutant("no_residual_normalisation")):
        assert acceptance.residual_probs(target, draft).sum() == pytest.approx(0.5)
    assert acceptance.residual_probs(target, draft).sum() == pytest.approx(1.0)


def test_greedy_mutant_reaches_the_loop_through_its_own_import(tiny_llama64):
    """The loop imported `verify` by name at import time: the mutant still reaches it (the code
    object is swapped in place), so a T = 1 run with no draft becomes the greedy output."""
    prompt = [1, 5, 9, 5]
    greedy = specdec.generate(tiny_llama64, None, prompt, max_new_tokens=8, stop_on_eos=False).token_ids
    sampled = [specdec.generate(tiny_llama64, None, prompt, max_new_tokens=8, temperature=1.0, seed=s,
                                stop_on_eos=False).token_ids for s in range(3)]
    assert any(s != greedy for s in sampled)
    with mutated(mutant("greedy_at_temperature")):
        assert all(specdec.generate(tiny_llama64, None, prompt, max_new_tokens=8, temperature=1.0, seed=s,
                                    stop_on_eos=False).token_ids == greedy for s in range(3))


def test_truncation_mutant_reaches_the_grower():
    """Under top-k the real grower records the truncated law; the mutant records softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampling = SamplingConfig(temperature=1.0, top_k=2)
    run = lambda: grow.grow_tree(shapes.ChainShape(1), logits, None, sampling,  # noqa: E731
                                 torch.Generator().manual_seed(0), 1)
    assert run().draft_probs[0, 0, 2:].sum() == 0
    with mutated(mutant("draft_probs_ignore_truncation")):
        recorded = run().draft_probs[0, 0]
    torch.testing.assert_close(recorded, logits[0].softmax(-1))


def test_sibling_mutant_judges_the_second_sibling_with_the_first_draft():
    """Target [0, .3, .7]; the first sibling (token 0, draft [.8, .1, .1]) is always rejected, the
    residual is [0, .25, .75]; the second sibling (token 1, drawn without replacement: draft
    [0, .5, .5]) is accepted with probability .25 / .5 = .5. Read with the first sibling's draft
    (.1 on token 1), it is always accepted."""
    draft = Draft(torch.tensor([[0, 1]]), torch.tensor([-1, -1]),
                  torch.tensor([[[0.8, 0.1, 0.1], [0.0, 0.5, 0.5]]], dtype=torch.float64))
    rows = torch.tensor([[0.0, 0.3, 0.7], [1 / 3] * 3, [1 / 3] * 3], dtype=torch.float64)

    def accepted_share() -> float:
        paths = [acceptance.accept_sampling(draft, rows, torch.Generator().manual_seed(s)).path for s in range(400)]
        return sum(p == [1] for p in paths) / len(paths)

    assert 0.4 < accepted_share() < 0.6
    with mutated(mutant("first_sibling_draft")):
        assert accepted_share() == 1.0
