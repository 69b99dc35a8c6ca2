"""specdec.measure.mutation (scripts/mutation_test.py's patching) patches a mutant in memory: the functions whose code an edit changes are
found and swapped (every importer sees them), an edit outside any function body rebinds the
top-level object everywhere it was imported, and nothing else is touched."""

import inspect

import torch

from specdec.core import sampling, tree
from specdec.measure import mutation as mutation_test


def test_an_edit_in_a_function_swaps_that_function_only():
    source = inspect.getsource(tree)
    edited = source.replace("while node >= 0:", "while node >= 1:")
    pairs, _ = mutation_test.swaps(tree, edited)
    assert [fn.__name__ for fn, _ in pairs] == ["path_to"]
    assert mutation_test.swaps(tree, source)[0] == []
    fn, new = pairs[0]
    saved = fn.__code__
    parents = torch.tensor([-1, 0, 1])
    try:
        fn.__code__ = new.__code__
        assert tree.path_to(parents, 2) == [1, 2]  # the mutant stops below node 0
    finally:
        fn.__code__ = saved
    assert tree.path_to(parents, 2) == [0, 1, 2]


def test_a_default_outside_a_function_rebinds_the_class_where_it_was_imported():
    source = inspect.getsource(sampling)
    line = next(i + 1 for i, text in enumerate(source.split("\n")) if "top_k: int = 0" in text)
    assert not any(a <= line <= b for a, b in mutation_test.function_bodies(source))
    assert mutation_test.top_level_names(source, line) == ["SamplingConfig"]
    edited = source.replace("top_k: int = 0", "top_k: int = 1")
    _, namespace = mutation_test.swaps(sampling, edited)
    real = sampling.SamplingConfig
    import specdec.core.acceptance as acceptance  # imports SamplingConfig by name

    try:
        assert mutation_test.rebind(sampling, namespace, ["SamplingConfig"]) >= 2
        assert sampling.SamplingConfig().top_k == 1 and acceptance.SamplingConfig is sampling.SamplingConfig
    finally:
        mutation_test.rebind(sampling, {"SamplingConfig": real}, ["SamplingConfig"])
    assert sampling.SamplingConfig is real and acceptance.SamplingConfig is real
