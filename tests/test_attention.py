"""`specdec_sdpa` (specdec.runtime.attention): the default attention of loaded targets, the same logits as
transformers' `sdpa`, and no per-head copy of the cached keys and values under a mask on CPU."""

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from torch.utils._python_dispatch import TorchDispatchMode

import specdec
from specdec.runtime.attention import NAME
from specdec.runtime.cache import KVCache


def _tree_logits(target, impl: str) -> torch.Tensor:
    """Logits of a 5-node tree block after a 37-token prefix (a masked forward), under `impl`."""
    target.model.set_attn_implementation(impl)
    cache = KVCache()
    target.prefill(list(range(3, 40)), cache)
    return target.forward(torch.tensor([[5, 6, 7, 8, 9]]), cache, torch.tensor([-1, 0, 0, 1, 2])).logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_default_attention_and_same_logits(family):
    target = specdec.load_target(f"tiny-{family}", kernel="torch")
    assert target.attention == NAME
    assert specdec.load_target(f"tiny-{family}", kernel="torch", attn_implementation="sdpa").attention == "sdpa"
    ours = _tree_logits(target, NAME)
    assert torch.equal(ours, _tree_logits(target, "sdpa"))
    eager = _tree_logits(target, "eager")  # a third, independent implementation: the same up to rounding
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_traced_cpu_forward_attends_by_float32_products(family, monkeypatch):
    """Traced by torch.compile (`is_compiling`), a masked CPU forward runs `_products`, not SDPA: the same logits as
    transformers' `eager` attention up to rounding, tree mask and grouped heads included (`_products` with its heads
    grouped the wrong way round fails this)."""
    from specdec.runtime import attention

    target = specdec.load_target(f"tiny-{family}", kernel="torch")
    eager = _tree_logits(target, "eager")
    cache = KVCache()
    target.prefill(list(range(3, 40)), cache)  # unmasked (causal): SDPA's, as before
    calls = []
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(hf_sdpa.torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1))
    target.model.set_attn_implementation(NAME)
    traced = target.forward(torch.tensor([[5, 6, 7, 8, 9]]), cache, torch.tensor([-1, 0, 0, 1, 2])).logits
    assert not calls
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)


def test_masks_transformers_builds_are_kept():
    """Masks transformers builds itself (per attention name) must be built for ours too: a causal
    chain after cached entries (what a chain verification and a prefill are) and a left-padded batch
    (training rollouts). A name without a mask function gets no mask at all, and these differ."""
    from specdec.training.eagle import rollout_batch

    target = specdec.tiny_target("llama")
    outs = {}
    for impl in ("sdpa", NAME):
        target.model.set_attn_implementation(impl)
        cache = KVCache()
        target.prefill(list(range(3, 23)), cache)
        chain = target.forward(torch.tensor([[5, 6, 7, 8]]), cache).logits
        rolled = rollout_batch(target, [list(range(3, 10)), list(range(3, 20))], max_new_tokens=6, temperature=0.0)
        outs[impl] = (chain, [s.tolist() for s in rolled.sequences], torch.cat(rolled.hidden))
    assert torch.equal(outs["sdpa"][0], outs[NAME][0])
    assert outs["sdpa"][1] == outs[NAME][1]
    assert torch.equal(outs["sdpa"][2], outs[NAME][2])


def test_masked_cpu_forward_does_not_repeat_kv(monkeypatch):
    """The point of `specdec_sdpa`: transformers' sdpa copies K/V per query head under a mask
    (`repeat_kv`); ours must not. The same check on plain `sdpa` shows the probe sees the copy."""
    target = specdec.tiny_target("llama", attn_implementation="sdpa")
    calls = []
    original = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: calls.append(n) or original(x, n))
    _tree_logits(target, "sdpa")
    assert calls, "the probe did not see transformers' repeat_kv: the check below would prove nothing"
    calls.clear()
    _tree_logits(target, NAME)
    assert calls == []


def test_other_attentions_are_left_alone():
    assert specdec.tiny_target("llama", attn_implementation="eager").attention == "eager"


class _Products(TorchDispatchMode):
    """The column counts of the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.columns.append(args[1].shape[1])
        return func(*args, **(kwargs or {}))


def test_one_row_paired_with_itself_is_the_first_column_of_the_pair():
    """`Target.pair_one_row`: a bf16 head scores one row, when pairing is on, as the first column of the row and its
    copy (a GEMM), else alone; never for an fp32 head; two rows are never padded."""
    assert not specdec.load_target("tiny-llama", kernel="torch").pair_one_row
    target = specdec.load_target("tiny-llama", kernel="torch", quant="bf16")
    w = target.lm_head.weight
    x = torch.randn(1, 1, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    for paired, columns, expected in ((True, 2, (w @ x[0].expand(2, -1).T)[:, :1].T), (False, 1, (w @ x[0].T).T)):
        target.pair_one_row = paired
        with _Products() as seen:
            assert torch.equal(target.logits(x), expected[None])
        assert seen.columns == [columns]  # the product it ran (the two may round alike)
    two = torch.cat([x, -x], 1)
    assert torch.equal(target.logits(two), (w @ two[0].T).T[None])
