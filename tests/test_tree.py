"""Tree geometry, shape parsing, and: every drafter yields a valid tree in every shape."""

import pytest
import torch

import specdec
from specdec.core import tree as tree_ops
from specdec.runtime.cache import KVCache
from specdec.drafters import DraftRequest, build_for_tests
from specdec.loop.decode import prefill
from specdec.loop.reference import reference_generate
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import ChainShape, DynamicShape, TreeShape, parse_shape

SHAPES = ["chain(1)", "chain(5)", "tree(3,2,2)", "tree(1,1,1,1)", "dynamic(top_k=3,depth=4,budget=10)",
          "dynamic(top_k=1,depth=3,budget=3)"]


def test_tree_geometry_worked_example():
    parents = tree_ops.as_parents([-1, -1, 0, 1])
    assert tree_ops.depths(parents).tolist() == [1, 1, 2, 2]
    assert tree_ops.path_to(parents, 3) == [1, 3]
    assert tree_ops.children(parents) == [[2], [3], [], [], [0, 1]]
    mask = tree_ops.ancestor_mask(parents)
    assert mask.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]
    assert tree_ops.chain_parents(4).tolist() == [-1, 0, 1, 2]
    keep = tree_ops.prune_to_depth(parents, 1)
    assert keep.tolist() == [0, 1]
    assert tree_ops.reindex(torch.tensor([-1, 0, 1, 0]), torch.tensor([0, 3])).tolist() == [-1, 0]


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, -2], [-1, 0, 5], [[-1]]])
def test_parents_that_are_not_a_tree_are_rejected(bad):
    with pytest.raises(ValueError, match="parents"):
        tree_ops.as_parents(bad)


def test_shape_parsing_round_trips():
    assert parse_shape("chain(4)") == ChainShape(4)
    assert parse_shape("tree(4,2,2)") == TreeShape((4, 2, 2))
    assert parse_shape("dynamic(top_k=8,depth=6,budget=32)") == DynamicShape(8, 6, 32)
    assert parse_shape("dynamic(8, 6, 32)") == DynamicShape(8, 6, 32)
    for s in ["chain(4)", "tree(4,2,2)", "dynamic(top_k=8,depth=6,budget=32)"]:
        assert str(parse_shape(s)) == s
    assert TreeShape((4, 2, 2)).max_nodes == 4 + 8 + 16


@pytest.mark.parametrize("bad, match", [
    ("chain(0)", "k >= 1"), ("tree(2,0)", "width >= 1"), ("tree()", "at least one width"),
    ("dynamic(top_k=8,depth=6,budget=0)", "budget"), ("dynamic(top_k=0)", "top_k"),
    ("dynamic(depth=0)", "depth"), ("star(3)", "cannot parse"), ("chain(x)", "not an integer"),
    ("dynamic(top_k=8,width=2)", "width"),
])
def test_bad_shapes_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_shape(bad)


def _request(target, ids, shape, sampling, max_depth=100):
    return DraftRequest(token_ids=torch.tensor([ids]), shape=parse_shape(shape), sampling=sampling,
                        generator=torch.Generator().manual_seed(0), max_depth=max_depth)


@pytest.mark.parametrize("name", specdec.drafters.names())
@pytest.mark.parametrize("shape", SHAPES)
def test_every_drafter_yields_a_valid_tree_in_every_shape(name, shape, tiny_llama64):
    """Parents precede children, depth and node budget respected, also under a max_depth cut."""
    prompt = [3, 5, 7, 3, 5, 7, 3, 5, 9, 3, 5]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        for max_depth in (100, 2):
            drafter = build_for_tests(name, target=tiny_llama64)
            drafter.reset()
            drafter.commit(prefill(tiny_llama64, KVCache(), prompt))
            req = _request(tiny_llama64, prompt, shape, sampling, max_depth)
            draft = drafter.propose(req)
            parents = draft.parents
            assert (parents < torch.arange(parents.numel())).all()
            s = parse_shape(shape)
            assert draft.num_nodes <= s.max_nodes
            if draft.num_nodes:
                depths = tree_ops.depths(parents)
                limit = {ChainShape: lambda: s.k, TreeShape: lambda: len(s.widths), DynamicShape: lambda: s.depth}
                assert int(depths.max()) <= min(limit[type(s)](), max_depth)
                if isinstance(s, TreeShape):
                    kids = tree_ops.children(parents)
                    for i, d in enumerate(depths.tolist()):
                        assert len(kids[i]) <= (s.widths[d] if d < len(s.widths) else 0)
                assert ((draft.tokens >= 0) & (draft.tokens < tiny_llama64.vocab_size)).all()
                if draft.draft_probs is not None:
                    sums = draft.draft_probs.sum(-1)
                    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)


WIDER_THAN_VOCAB = ["tree(100,2)", "dynamic(top_k=100,depth=2,budget=300)"]


@pytest.mark.parametrize("name", specdec.drafters.names())
@pytest.mark.parametrize("shape", WIDER_THAN_VOCAB)
def test_widths_beyond_the_vocabulary_are_clamped(name, shape, tiny_llama64):
    """A width or top_k above the vocabulary (64) drafts at most 64 distinct children per node, for
    every drafter, greedy and sampling, and generation stays exact."""
    prompt = [3, 5, 7, 3, 5, 7, 3, 5, 9, 3, 5]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        drafter = build_for_tests(name, target=tiny_llama64)
        drafter.reset()
        drafter.commit(prefill(tiny_llama64, KVCache(), prompt))
        draft = drafter.propose(_request(tiny_llama64, prompt, shape, sampling))
        tokens = draft.tokens[0].tolist()
        for kids in tree_ops.children(draft.parents):
            assert len(kids) <= tiny_llama64.vocab_size
            assert len({tokens[k] for k in kids}) == len(kids), "siblings repeat a token"
    ref = reference_generate(tiny_llama64, prompt, max_new_tokens=6, stop_on_eos=False)
    out = specdec.generate(tiny_llama64, build_for_tests(name, target=tiny_llama64), prompt, shape=shape,
                           max_new_tokens=6, stop_on_eos=False)
    assert out.token_ids == ref


def test_dynamic_tree_records_cumulative_scores_in_growth_order(tiny_llama64):
    """Draft.scores of a dynamic tree: the cumulative draft log-probability, a child's never above its
    parent's, and node ids in growth order (ascending, as BlockSlots expects)."""
    drafter = build_for_tests("small", target=tiny_llama64)
    prompt = [3, 5, 7, 3, 5]
    drafter.reset()
    drafter.commit(prefill(tiny_llama64, KVCache(), prompt))
    draft = drafter.propose(_request(tiny_llama64, prompt, "dynamic(top_k=4,depth=4,budget=12)", SamplingConfig()))
    assert draft.scores is not None and draft.scores.shape == (draft.num_nodes,)
    assert (draft.scores <= 0).all()
    parents = draft.parents
    has = parents >= 0
    assert (draft.scores[has] <= draft.scores[parents[has]] + 1e-6).all()
    ids = draft.node_ids.tolist()
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    # A depth-1 node's score is its own log-probability under the drafter.
    root_logprobs = drafter.model.forward(torch.tensor([prompt]), KVCache()).logits[0, -1].float().log_softmax(-1)
    first = (parents == -1).nonzero().flatten()
    torch.testing.assert_close(draft.scores[first], root_logprobs[draft.tokens[0, first]], rtol=1e-4, atol=1e-4)
