"""A chain forward (a prefill, a one-token step, a chain verification) leaves the causal mask to
the model, as HF `generate` does: no [n, past + n] mask is built, SDPA runs unmasked where it can,
and the result equals the explicit tree-mask forward, in either cache, after evictions too."""

import pytest
import torch

from specdec.runtime.cache import KVCache
from specdec.runtime.model import is_chain, tree_attention
from specdec.runtime.static_cache import StaticKVCache

CACHES = {"dynamic": KVCache, "static": lambda: StaticKVCache(64)}


def _explicit(target, tokens, cache):
    """The same chain through the explicit 4D tree mask (what every forward used before)."""
    positions, mask = tree_attention(None, tokens.shape[1], cache.length, target.dtype, cache.next_position)
    return target.base(input_ids=tokens, attention_mask=mask[None, None], position_ids=positions[None],
                       cache=cache.hf, use_cache=True).last_hidden_state


@pytest.mark.parametrize("kind", CACHES)
def test_chain_forwards_pass_no_mask_and_equal_the_tree_mask(tiny64, kind):
    masks = []
    hook = tiny64.base.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")),
                                                 with_kwargs=True)
    try:
        ours, ref = CACHES[kind](), CACHES[kind]()
        steps = [torch.tensor([[5, 9, 2, 7, 1, 3, 8]]), torch.tensor([[4]]), torch.tensor([[6, 2, 9]])]
        for i, tokens in enumerate(steps):
            parents = None if i != 1 else torch.tensor([-1])  # the loop's plain step passes [-1]
            hidden = tiny64.forward(tokens, ours, parents).hidden
            torch.testing.assert_close(hidden, _explicit(tiny64, tokens, ref), rtol=0, atol=1e-12)
            assert ours.length == ref.length and ours.next_position == ref.next_position
    finally:
        hook.remove()
    assert masks[::2] == [None, None, None]  # ours; the odd entries are the explicit reference's
    # A tree block still gets its 4D mask.
    tiny64.forward(torch.tensor([[1, 2]]), ours, torch.tensor([-1, -1]))
    assert masks[-1] is not None and masks[-1].dim() == 4


def test_one_token_after_evictions_sees_what_the_cache_holds(tiny_llama64):
    thin, ref = KVCache(), KVCache()
    for cache in (thin, ref):
        tiny_llama64.prefill(list(range(3, 22)), cache)
        cache.retain(torch.tensor([0, 1] + list(range(10, 19))))
    hidden = tiny_llama64.forward(torch.tensor([[22]]), thin).hidden
    torch.testing.assert_close(hidden, _explicit(tiny_llama64, torch.tensor([[22]]), ref), rtol=0, atol=1e-12)
    assert thin.next_position == 20 and thin.length == 12


def test_is_chain():
    assert is_chain(torch.tensor([-1]), 1) and is_chain([-1, 0, 1], 3)
    assert not is_chain(torch.tensor([-1, -1]), 2) and not is_chain(torch.tensor([-1, 0, 1]), 2)
