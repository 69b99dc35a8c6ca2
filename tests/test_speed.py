"""The speed seams' invariants: the step-time split adds up, summaries stay short, EAGLE drafts
within its draft vocabulary without full-vocabulary tensors (and still records full-width
draft_probs for sampling), and the static cache is exact and equals a prefill after every step."""

import pytest
import torch

import specdec
from specdec.runtime.cache import KVCache
from specdec.drafters import DraftRequest, build, build_for_tests
from specdec.runtime.forwards import CACHES
from specdec.loop.decode import prefill
from specdec.loop.reference import reference_generate
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import parse_shape
from specdec.runtime.static_cache import StaticKVCache

PROMPT = [3, 5, 7, 3, 5, 7, 3, 5, 9, 3, 5]


def test_step_time_split_adds_up(tiny_llama64):
    drafter = build("eagle", target=tiny_llama64, head="random")
    out = specdec.generate(tiny_llama64, drafter, PROMPT, shape="chain(3)", max_new_tokens=10, stop_on_eos=False)
    stats = out.stats
    for step in stats.steps:
        assert step.draft_time_s >= 0 and step.target_time_s > 0 and step.other_time_s >= 0
        assert step.shape in ("chain(3)", "")  # "" = the last token, no draft asked
    split = stats.time_split()
    assert abs(sum(split.values()) - 1) < 1e-9
    steps_total = stats.draft_time_s + stats.target_time_s + stats.other_time_s
    assert steps_total <= stats.wall_time_s - stats.prefill_time_s + 1e-6
    assert stats.summary()["time_split"] == split


def test_stats_and_target_reprs_are_one_short_line(tiny_llama64):
    out = specdec.generate(tiny_llama64, None, PROMPT, max_new_tokens=8, stop_on_eos=False)
    text = repr(out.stats)
    assert "\n" not in text and len(text) < 200 and "StepRecord" not in text
    for word in ("8 tokens", "steps", "MAL", "tokens/s"):
        assert word in text
    text = repr(tiny_llama64)
    assert "\n" not in text and len(text) < 200
    for word in (tiny_llama64.name, "float64", "cpu", "quant='none'", "parameters="):
        assert word in text


def test_eagle_scores_only_its_draft_vocabulary(tiny_llama64):
    drafter = build("eagle", target=tiny_llama64, head="random", draft_vocab=20)
    features = torch.randn(1, 3, tiny_llama64.hidden_size, dtype=tiny_llama64.dtype)
    assert drafter._logits(features).shape == (1, 3, 20)
    drafter.reset()
    drafter.commit(prefill(tiny_llama64, KVCache(), PROMPT))
    request = DraftRequest(token_ids=torch.tensor([PROMPT]), shape=parse_shape("chain(3)"),
                           sampling=SamplingConfig(temperature=1.0), generator=torch.Generator().manual_seed(0),
                           max_depth=8)
    draft = drafter.propose(request)
    assert draft.draft_probs.shape == (1, 3, tiny_llama64.vocab_size)
    outside = torch.ones(tiny_llama64.vocab_size, dtype=torch.bool)
    outside[drafter.vocab] = False
    assert (draft.draft_probs[..., outside] == 0).all()
    assert set(draft.tokens[0].tolist()) <= set(drafter.vocab.tolist())
    sums = draft.draft_probs.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)


# ---- the static (preallocated) cache -----------------------------------------------------------

class _CheckingDrafter:
    """Wraps a drafter; on every commit compares the loop's cache with a fresh prefill of the
    committed tokens but the root (what the target's cache must then hold)."""

    def __init__(self, inner, target, caches):
        self.inner, self.target, self.caches, self.name, self.checked = inner, target, caches, inner.name, 0

    def reset(self):
        self.inner.reset()

    def propose(self, request):
        return self.inner.propose(request)

    def commit(self, step):
        fresh = KVCache()
        self.target.prefill(step.token_ids[0, :-1].tolist(), fresh)
        for (k1, v1), (k2, v2) in zip(self.caches[-1].tensors(), fresh.tensors(), strict=True):
            torch.testing.assert_close(k1, k2)
            torch.testing.assert_close(v1, v2)
        self.checked += 1
        self.inner.commit(step)


@pytest.mark.parametrize("kind", ["static", "graphs"])
@pytest.mark.parametrize("name", specdec.drafters.names())
@pytest.mark.parametrize("shape", ["chain(3)", "tree(2,2)", "dynamic(top_k=3,depth=3,budget=6)"])
def test_preallocated_caches_are_exact_and_equal_a_prefill_after_every_step(tiny_llama64, kind, name, shape,
                                                                             monkeypatch):
    caches, make = [], CACHES[kind]

    def recording(*args):
        cache, forward = make(*args)
        caches.append(cache)
        return cache, forward

    monkeypatch.setitem(CACHES, kind, recording)
    drafter = _CheckingDrafter(build_for_tests(name, target=tiny_llama64), tiny_llama64, caches)
    out = specdec.generate(tiny_llama64, drafter, PROMPT, shape=shape, max_new_tokens=12, stop_on_eos=False,
                           cache=kind)
    assert out.token_ids == reference_generate(tiny_llama64, PROMPT, max_new_tokens=12, stop_on_eos=False)
    assert drafter.checked == out.stats.num_steps + 1  # the prefill, then every step
    if kind == "static":
        assert caches[-1].capacity == len(PROMPT) + 12 + parse_shape(shape).max_nodes


def test_static_cache_bad_sizes_fail_clearly(tiny_llama64):
    with pytest.raises(ValueError, match="cache_capacity=20 is too short"):  # chain(4) needs 4 more than plain
        specdec.generate(tiny_llama64, build("none", target=tiny_llama64), PROMPT, max_new_tokens=8, cache="static",
                         cache_capacity=20)
    with pytest.raises(ValueError, match=f"cache_capacity={len(PROMPT) + 7} is too short"):
        specdec.generate(tiny_llama64, None, PROMPT, max_new_tokens=8, cache="static", cache_capacity=len(PROMPT) + 7)
    with pytest.raises(ValueError, match="unknown cache 'paged'"):
        specdec.generate(tiny_llama64, None, PROMPT, max_new_tokens=8, cache="paged")
    cache = StaticKVCache(4)
    with pytest.raises(ValueError, match="static cache overflow"):
        tiny_llama64.prefill(PROMPT, cache)
    with pytest.raises(ValueError, match="capacity >= 1"):
        StaticKVCache(0)


def test_static_cache_over_filled_buffers_keeps_chosen_rows_in_place():
    """`over` adopts filled buffers; `select_rows` keeps rows (in order) in the same storage, and
    entries written afterwards land after the kept ones."""
    keys = [torch.arange(4 * 2 * 6 * 3, dtype=torch.float32).view(4, 2, 6, 3)]  # [B=4, heads, capacity 6, D]
    values = [-keys[0].clone()]
    cache = StaticKVCache.over(keys, values, 4)
    assert cache.length == 4 and cache.capacity == 6
    before = keys[0].clone()
    storage = keys[0].data_ptr()
    cache.select_rows(torch.tensor([1, 3]))
    (k, v), = cache.tensors()
    assert k.shape == (2, 2, 4, 3) and torch.equal(k, before[[1, 3], :, :4]) and torch.equal(v, -k)
    assert cache.keys[0].data_ptr() == storage  # no second copy of the cache
    cache.append([(torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3))])
    (k, _), = cache.tensors()
    assert cache.length == 5 and torch.equal(k[:, :, 4], torch.ones(2, 2, 3))
    assert torch.equal(k[:, :, :4], before[[1, 3], :, :4])


def test_a_dropped_static_cache_frees_its_buffers_at_once(tiny_llama64):
    """No reference cycle between a StaticKVCache and the writer the model calls (`hf`): dropping the
    cache frees its buffers without waiting for Python's cycle collector (a rollout batch's are GBs)."""
    import gc
    import weakref

    gc.disable()
    try:
        cache = StaticKVCache(32)
        tiny_llama64.prefill(PROMPT, cache)
        gone = weakref.ref(cache.keys[0])
        del cache
        assert gone() is None
    finally:
        gc.enable()
