"""Batch edge cases of `generate_batch` for every registered drafter: steps that draft nothing
before a drafter's first forward (`max_new_tokens` 1 and 2, `shape="auto"`), prompts of mixed
lengths, a batch of one-token prompts (a prefill that writes nothing, so the target's cache reports
one row until the first step), and one drafter reused across calls and across batch sizes. Every row
equals plain greedy decoding of its prompt alone (tiny fp64 target, T = 0)."""

import pytest

import specdec
from specdec.drafters import names
from specdec.drafters.registry import build_for_tests

SHAPES = ["chain(4)", "tree(2,2,1)", "dynamic(top_k=3,depth=3,budget=8)", "auto"]
BATCHES = [[[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]], [[5], [3, 1, 4, 1, 5, 9, 2, 6]],
           [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]], [[5], [3], [5]]]


def plain(target, prompt, limit):
    return specdec.generate(target, None, prompt, max_new_tokens=limit, chat=False).token_ids


@pytest.mark.parametrize("name", [n for n in names() if n != "none"])
@pytest.mark.parametrize("shape", SHAPES)
def test_short_batches_reuse_one_drafter_and_equal_plain_decoding(tiny_llama64, name, shape):
    drafter = build_for_tests(name, target=tiny_llama64)
    if not getattr(drafter, "batchable", False):
        pytest.skip(f"{name} drafts one prompt at a time")
    for limit in (1, 2, 5):
        for prompts in BATCHES:  # the same drafter across calls and batch sizes 3, 2, 3, 3
            out = specdec.generate_batch(tiny_llama64, drafter, prompts, shape=shape, max_new_tokens=limit, chat=False)
            assert [o.token_ids for o in out] == [plain(tiny_llama64, p, limit) for p in prompts], (limit, prompts)
