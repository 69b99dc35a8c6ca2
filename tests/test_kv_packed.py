"""Packed KV caches (`specdec.runtime.packed_cache`) under the self-drafter.

- packing round-trips codes, and a packed cache holds fewer bytes than the entries it replaces;
- T = 0: every packed layout, alone and under an evicting policy, reproduces the cacheless reference
  through `specdec.generate`, and the draft cache stays the policy of a fresh prefill;
- channel keys under eviction keep whole groups: every retained entry is held exactly as the uncut cache holds it,
  partial groups' extra entries included and counted in the bytes held;
- the identity check has power: a verifier run over a lossy cache diverges from the reference.
"""

import pytest
import torch

import specdec
from specdec.drafters import build
from specdec.drafters.kv_policy import ModelFacts, fake_quantize, parse_kv_policy
from specdec.loop.reference import reference_generate
from specdec.runtime.cache import KVCache
from specdec.runtime.packed_cache import PackedFormat, PackedKVCache, _pack, _unpack, held_bytes
from test_cache import assert_self_draft_cache_is_the_policy_of_a_prefill

PROMPT = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 2, 3, 5, 7, 11, 13]
PACKED = [f"quant(bits={b},group=4,keys={k})" for b in (2, 4, 8) for k in ("token", "channel")] + [
    "window(sink=1,recent=6)+quant(bits=4,group=4,keys=token)", "snapkv(budget=8,window=2)+quant(bits=2,keys=token)",
    "snapkv(budget=6,window=2)+quant(bits=4,group=4,keys=channel)"] + [
    f"window(sink=1,recent=6)+quant(bits={b},group=4,keys=channel)" for b in (2, 4, 8)]


@pytest.fixture(scope="module")
def world():
    """A tiny fp64 target whose greedy path depends on its KV (seed 0's barely does: see the last test)."""
    return specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=1, logit_scale=4.0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_round_trips_and_shrinks(bits):
    codes = torch.randint(0, 2**bits, (1, 2, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = _pack(codes, bits)
    assert packed.shape[-1] == 16 * bits // 8 and torch.equal(_unpack(packed, bits), codes)
    x = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(1))
    for keys in ("token", "channel"):
        cache, full = PackedKVCache(PackedFormat(bits, 8, keys)), KVCache()
        cache.append([(x, x)])
        full.append([(x, x)])
        assert cache.length == 64 and cache.pending == 0
        assert held_bytes(cache) < held_bytes(full) * (bits + 8) / 32  # codes plus two fp16 per 8 values
        k, v = cache.tensors()[0]
        assert (v - x).abs().max() <= (x.amax() - x.amin()) / (2**bits - 1)
        assert (k - x).abs().max() <= (x.amax() - x.amin()) / (2**bits - 1)


def test_channel_keys_wait_for_a_whole_group():
    x = torch.randn(1, 2, 11, 8, generator=torch.Generator().manual_seed(2))
    cache = PackedKVCache(PackedFormat(4, 4, "channel"))
    cache.append([(x[..., :5, :], x[..., :5, :])])
    cache.append([(x[..., 5:, :], x[..., 5:, :])])
    assert cache._layers()[0].count == 8 and cache.pending == 3
    torch.testing.assert_close(cache.tensors()[0][0][..., 8:, :], x[..., 8:, :], rtol=0, atol=0)
    with pytest.raises(ValueError, match="packed"):
        cache.truncate(7)


def test_channel_keys_evict_whole_groups_and_hold_what_they_report():
    """G 4, 19 entries (groups 0..3 packed, 16..18 pending): window(1, 6) retains 0 and 13..18, so groups 0, 3 and
    the pending one stay (12 is an extra entry of group 3); a rule dropping partial groups would lose 13..15."""
    x = torch.randn(1, 2, 19, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    policy = parse_kv_policy("window(sink=1,recent=6)+quant(bits=4,group=4,keys=channel)")
    policy.check(ModelFacts(head_dim=8, context_length=64))
    cache, uncut = policy.new_cache(), PackedKVCache(policy.packed)
    cache.append([(x, x)])
    uncut.append([(x, x)])
    policy.after_commit(cache)
    kept = [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18]
    assert (cache.length, cache.next_position, cache._layers()[0].count, cache.pending) == (11, 19, 8, 3)
    for got, want in zip(cache.tensors()[0], uncut.tensors()[0]):
        torch.testing.assert_close(got, want[..., kept, :], rtol=0, atol=0)
    fresh = PackedKVCache(policy.packed)  # the kept entries alone pack into the same groups
    fresh.append([(x[..., kept, :], x[..., kept, :])])
    # per layer: key and value codes 2 x 8 x 2 x 8 / 2 B, key zero+scale 2 groups x 2 x 8 x 4 B,
    # value zero+scale 8 x 2 x 2 x 4 B, pending 3 x 2 x 8 x 8 B x (k, v)
    assert held_bytes(cache) == held_bytes(fresh) == 2 * 64 + 128 + 128 + 768
    policy.after_commit(cache)  # idempotent: the window of what it holds is what it holds
    assert cache.length == 11 and cache.next_position == 19
    with pytest.raises(ValueError, match="whole groups of 4"):
        cache._layers()[0].select_packed(torch.tensor([0, 1, 2, 3, 5, 6, 7]))


@pytest.mark.parametrize("kv", PACKED)
def test_packed_self_draft_reproduces_greedy(world, kv):
    ref = reference_generate(world, PROMPT, max_new_tokens=20, stop_on_eos=False)
    drafter = build("self_draft", target=world, kv=kv)
    for shape in ["chain(4)", "tree(2,2,1)"]:
        out = specdec.generate(world, drafter, PROMPT, shape=shape, max_new_tokens=20, stop_on_eos=False)
        assert out.token_ids == ref, f"kv={kv} {shape} diverged from greedy"
        assert isinstance(drafter.cache, PackedKVCache)
        assert drafter.cache.evicted > 0 or not drafter.policy.evicts, f"kv={kv} evicted nothing: no power"
    committed = PROMPT + out.token_ids
    drafter.reset()
    propose = drafter.propose
    checked = []

    def checking(request):
        assert_self_draft_cache_is_the_policy_of_a_prefill(world, drafter, request.token_ids[0].tolist(),
                                                          len(PROMPT))
        checked.append(1)
        return propose(request)

    drafter.propose = checking
    specdec.generate(world, drafter, PROMPT, shape="chain(3)", max_new_tokens=12, stop_on_eos=False)
    assert len(checked) >= 3 and len(committed) > len(PROMPT)


def test_packed_policies_refuse_what_they_cannot_hold(world):
    with pytest.raises(ValueError, match="keys must be one of"):
        build("self_draft", target=world, kv="quant(bits=4,keys=row)")
    with pytest.raises(ValueError, match="a cache is packed once"):
        build("self_draft", target=world, kv="quant(bits=4,keys=token)+quant(bits=4,keys=channel)")
    drafter = build("self_draft", target=world, kv="quant(bits=4,keys=token)")
    assert not drafter.batchable


def test_a_verifier_over_a_lossy_cache_fails_the_identity(world, monkeypatch):
    """The planted bug: the target's own cache is fake-quantized after every forward."""
    ref = reference_generate(world, PROMPT, max_new_tokens=20, stop_on_eos=False)
    forward = world.forward

    def lossy(tokens, cache, *args, **kwargs):
        out = forward(tokens, cache, *args, **kwargs)
        cache.set_tensors([(fake_quantize(k, 2, 8), fake_quantize(v, 2, 8)) for k, v in cache.tensors()])
        return out

    monkeypatch.setattr(world, "forward", lossy)
    out = specdec.generate(world, None, PROMPT, max_new_tokens=20, stop_on_eos=False, cache="dynamic")
    assert out.token_ids != ref
