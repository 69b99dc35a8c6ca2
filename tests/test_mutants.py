"""The certificate's mutants edit the real code: each applies, changes what runs, and is undone.

The power of the reference cases against every mutant (p <= 1e-6) is test_exactness.py's; the
mutants' effect on the exact one-step law (no sampling noise) is test_exact_law.py's."""

import importlib

import pytest
import torch

import specdec
from specdec.core import acceptance, grow, shapes
from specdec.core.draft import Draft
from specdec.core.sampling import SamplingConfig
from specdec.certify.mutants import MUTANTS, Mutant, MutantDoesNotApply, mutant, mutated


def real_function(m: Mutant):
    function = importlib.import_module(m.module)
    for part in m.function.split("."):
        function = getattr(function, part)
    return function


def test_there_are_enough_mutants_each_with_a_known_reference_case():
    from specdec.certify.power import REFERENCE_CASES

    assert len(MUTANTS) >= 13 and len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert {m.case for m in MUTANTS} <= set(REFERENCE_CASES)
    assert {m.module for m in MUTANTS} >= {"specdec.core.acceptance", "specdec.core.grow", "specdec.core.sampling",
                                          "specdec.runtime.model", "specdec.runtime.cache"}


@pytest.mark.parametrize("m", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_and_is_undone(m):
    function = real_function(m)
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


def test_position_mutant_moves_tree_nodes_to_chain_positions():
    """`tree_block` of a root with two children after 10 cached entries: depths put both children at
    position 11; the mutant puts the second at 12 (its index in the block)."""
    from specdec.runtime.model import tree_block

    parents = torch.tensor([-1, 0, 0])
    assert tree_block(parents, 3, 10)[1].tolist() == [10, 11, 11]
    with mutated(mutant("tree_positions_in_chain")):
        assert tree_block(parents, 3, 10)[1].tolist() == [10, 11, 12]
    assert tree_block(parents, 3, 10)[1].tolist() == [10, 11, 11]


def test_cache_mutants_reach_a_method(tiny64):
    """`KVCache.keep` of block entries [0, 2] keeps them; `keep_ignores_path` keeps [0, 1] instead, and
    `rollback_keeps_one_more` keeps one entry past a prefix."""
    from specdec.runtime.cache import KVCache

    def kept(offsets, m=None):
        cache = KVCache()
        tiny64.prefill(list(range(1, 9)), cache)  # 8 entries, positions 0..7
        keys = cache.tensors()[0][0][0, 0].clone()  # [S, D] of the first layer and head
        if m is None:
            cache.keep(4, offsets)
        else:
            with mutated(mutant(m)):
                cache.keep(4, offsets)
        after = cache.tensors()[0][0][0, 0]
        return [next(i for i in range(8) if torch.equal(after[j], keys[i])) for j in range(4, cache.length)]

    assert kept([0, 2]) == [4, 6] and kept([0, 1]) == [4, 5]
    assert kept([0, 2], "keep_ignores_path") == [4, 5]
    assert kept([0, 1], "rollback_keeps_one_more") == [4, 5, 6]
