"""After every rollback, a cache equals a fresh prefill of the tokens it is supposed to hold."""

import pytest
import torch

import specdec
from specdec.core import tree as tree_ops
from specdec.runtime.cache import KVCache
from specdec.drafters import build
from specdec.drafters.draft_model import ModelDrafter
from specdec.drafters.self_draft import SelfDrafter
from specdec.runtime.forwards import CACHES
from specdec.drafters.kv_policy import apply_to_prefill, attention_probe


def assert_cache_equals_prefill(target, cache: KVCache, token_ids: list[int]) -> None:
    fresh = KVCache()
    if token_ids:
        target.prefill(token_ids, fresh)
    assert cache.length == len(token_ids)
    for (k, v), (k0, v0) in zip(cache.tensors(), fresh.tensors()):
        torch.testing.assert_close(k, k0, rtol=0, atol=1e-10)
        torch.testing.assert_close(v, v0, rtol=0, atol=1e-10)


def test_keep_path_after_a_tree_forward_equals_prefill(tiny64):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (9,), generator=gen).tolist()
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5, 5])  # root (block 0) then 8 draft nodes
    tokens = torch.randint(0, 64, (1, parents.numel()), generator=gen)
    for leaf in range(parents.numel()):
        cache = KVCache()
        target = tiny64
        target.prefill(prompt, cache)
        target.forward(tokens, cache, parents)
        path = tree_ops.path_to(parents, leaf)
        cache.keep(len(prompt), path)
        assert_cache_equals_prefill(target, cache, prompt + tokens[0, path].tolist())


def test_truncate_equals_prefill(tiny_llama64):
    cache = KVCache()
    ids = list(range(3, 15))
    tiny_llama64.prefill(ids, cache)
    cache.truncate(7)
    assert_cache_equals_prefill(tiny_llama64, cache, ids[:7])
    with pytest.raises(ValueError, match="outside this cache"):
        cache.truncate(8)


def test_keep_rejects_offsets_outside_the_block(tiny_llama64):
    cache = KVCache()
    tiny_llama64.prefill([1, 2, 3], cache)
    with pytest.raises(ValueError, match="outside"):
        cache.keep(2, [0, 1])


class _Recorder(KVCache):
    made: list = []

    def __init__(self):
        super().__init__()
        _Recorder.made.append(self)


@pytest.mark.parametrize("name, shape, temperature", [
    ("small", "tree(3,2,2)", 0.0), ("small", "dynamic(top_k=3,depth=4,budget=10)", 1.0),
    ("small", "chain(4)", 1.0), ("random", "tree(2,2)", 1.0), ("ngram", "chain(3)", 0.0),
    ("self_draft", "tree(3,2,2)", 0.0), ("self_draft:window(sink=2,recent=4)", "chain(4)", 1.0),
    ("self_draft:snapkv(budget=5,window=2)", "dynamic(top_k=3,depth=4,budget=10)", 1.0),
    ("self_draft:quant(bits=2,group=4)", "tree(3,2,2)", 0.0),
    ("self_draft:snapkv(budget=4,window=1)+window(sink=1,recent=4)+quant(bits=4)", "chain(3)", 1.0),
])
@pytest.mark.parametrize("draft_cache", ["dynamic", "graphs"])
def test_caches_equal_prefill_after_every_step_of_the_loop(tiny_llama64, monkeypatch, name, shape, temperature,
                                                          draft_cache):
    """At every draft request, the target's cache holds exactly the committed tokens but the root,
    and a model drafter's cache holds exactly the tokens it claims to have consumed; a self-drafter's
    cache equals its KV policy applied to a fresh prefill (for `full`: the target's own cache).
    Model drafters run their own cache both ways: growing, and the preallocated static-shape fast
    path (`graphs`, which evicting KV policies cannot use)."""
    name, _, kv = name.partition(":")
    if draft_cache == "graphs" and (name not in ("small", "self_draft") or "window" in kv or "snapkv" in kv):
        pytest.skip("no model-drafter cache of its own, or a KV policy that evicts")
    _Recorder.made = []
    monkeypatch.setitem(CACHES, "dynamic", lambda target, capacity, buckets: (_Recorder(), target.forward))
    options = {"kv": kv} if kv else {}
    if name in ("small", "self_draft"):
        options["cache"] = draft_cache
    drafter = build(name, target=tiny_llama64, **options)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    checked = []
    propose = drafter.propose

    def checking_propose(request):
        committed = request.token_ids[0].tolist()
        assert_cache_equals_prefill(tiny_llama64, _Recorder.made[-1], committed[:-1])
        if isinstance(drafter, ModelDrafter):
            assert_cache_equals_prefill(drafter.model, drafter.cache, committed[: drafter.consumed])
        if isinstance(drafter, SelfDrafter):
            assert_self_draft_cache_is_the_policy_of_a_prefill(tiny_llama64, drafter, committed, len(prompt))
        checked.append(len(committed))
        return propose(request)

    drafter.propose = checking_propose
    specdec.generate(tiny_llama64, drafter, prompt, shape=shape, max_new_tokens=24,
                     temperature=temperature, stop_on_eos=False)
    assert len(checked) >= 3
    if name in ("small", "self_draft"):
        assert type(drafter.cache).__name__ == ("StaticKVCache" if draft_cache == "graphs" else "KVCache")


def assert_self_draft_cache_is_the_policy_of_a_prefill(target, drafter: SelfDrafter, committed: list[int],
                                                      prompt_length: int) -> None:
    fresh = KVCache()
    target.prefill(committed[:-1], fresh)
    exact = fresh.tensors()[: drafter.layers]
    if drafter.policy.spec == "full":
        expected = exact  # the target's own cache
    else:
        probe = attention_probe(drafter.model, committed[:prompt_length])
        expected = apply_to_prefill(drafter.policy, exact, prompt_length - 1, probe).tensors()
    assert drafter.cache.next_position == len(committed) - 1
    assert len(drafter.cache.tensors()) == len(expected)
    for (k, v), (k0, v0) in zip(drafter.cache.tensors(), expected):
        torch.testing.assert_close(k, k0, rtol=0, atol=1e-10)
        torch.testing.assert_close(v, v0, rtol=0, atol=1e-10)
