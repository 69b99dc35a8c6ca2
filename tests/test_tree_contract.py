"""The contract of `specdec.core.tree` on random trees: depths, ancestor masks, paths, children,
pruning and reindexing against their definitions, the device path of `depths`, and the exact error
messages of `as_parents`. These tests kill the mutants of tree.py that the exactness tests let
through (the mutmut audit of docs/measurements/mutation-testing.md)."""

import random

import pytest

from specdec.core import tree as tree_ops


def random_parents(n: int, seed: int) -> list[int]:
    """A random tree of n nodes: node i hangs under the root or under any earlier node."""
    rng = random.Random(seed)
    return [rng.randrange(-1, i) for i in range(n)]


def ancestors(parents: list[int], node: int) -> list[int]:
    """node and its ancestors, from the node up (the definition)."""
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out


TREES = [random_parents(n, seed) for n, seed in ((1, 0), (2, 1), (5, 2), (9, 3), (17, 4), (33, 5))] + [
    [-1], list(range(-1, 19)), [-1] * 6]


@pytest.mark.parametrize("parents", TREES)
def test_geometry_is_its_definition_on_random_trees(parents):
    p = tree_ops.as_parents(parents)
    n = len(parents)
    assert tree_ops.depths(p).tolist() == [len(ancestors(parents, i)) for i in range(n)]
    mask = tree_ops.ancestor_mask(p)
    assert mask.tolist() == [[j in ancestors(parents, i) for j in range(n)] for i in range(n)]
    for i in range(n):
        assert tree_ops.path_to(p, i) == ancestors(parents, i)[::-1]
    assert tree_ops.path_to(p, -1) == []
    kids = tree_ops.children(p)
    assert len(kids) == n + 1
    assert kids[n] == [i for i in range(n) if parents[i] == -1]
    assert all(kids[j] == [i for i in range(n) if parents[i] == j] for j in range(n))


@pytest.mark.parametrize("parents", TREES)
def test_a_pruned_tree_is_reindexed_onto_its_own_nodes(parents):
    p = tree_ops.as_parents(parents)
    depth = tree_ops.depths(p)
    for limit in range(1, int(depth.max()) + 1):
        keep = tree_ops.prune_to_depth(p, limit)
        assert keep.tolist() == [i for i in range(len(parents)) if int(depth[i]) <= limit]
        sub = tree_ops.reindex(p, keep).tolist()
        old = keep.tolist()
        assert sub == [-1 if parents[i] == -1 else old.index(parents[i]) for i in old]


def test_depths_of_device_parents_take_the_mask_path():
    """Parents off the host (here the meta device: shapes only) are not walked on the host."""
    parents = tree_ops.as_parents([-1, 0, 1, 0, -1]).to("meta")
    out = tree_ops.depths(parents)
    assert out.shape == (5,) and out.device.type == "meta"


def test_the_chain_is_a_path():
    assert tree_ops.chain_parents(1).tolist() == [-1]
    assert tree_ops.chain_parents(5).tolist() == [-1, 0, 1, 2, 3]


@pytest.mark.parametrize("bad, message", [
    ([[-1, 0]], r"^parents must be 1-D \(one entry per draft node\), got shape \(1, 2\)$"),
    ([-1, 0, 5, 7], r"^parents is not a tree: parents\[2\] = 5; each entry must be -1 \(child of the root\) "
                    r"or the index of an earlier node \(0\.\.1\)$"),
    ([-1, -2], r"^parents is not a tree: parents\[1\] = -2; .* \(0\.\.0\)$"),
    ([-1, 1], r"^parents is not a tree: parents\[1\] = 1; .* \(0\.\.0\)$"),
])
def test_a_bad_parents_array_is_named_exactly(bad, message):
    with pytest.raises(ValueError, match=message):
        tree_ops.as_parents(bad)
