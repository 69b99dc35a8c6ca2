"""specdec's own CPU kernels (`native_int4h8`): the products they compute, that a row's result never depends on the
batch around it, and the backend over torchao_int4h8's weights."""

import pytest
import torch

import specdec
from specdec import quant

pytestmark = pytest.mark.skipif(not quant.availability("native_int4h8").ok,
                                reason="native_int4h8 cannot build here (no C++ compiler, or no torchao)")


@pytest.fixture(scope="module")
def tiny():
    return specdec.tiny_target("llama", vocab_size=64, hidden_size=64, dtype=torch.float32, seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def ops():
    from specdec.quant import native

    native.load()
    return torch.ops.specdec_lowbit


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    """torchao's int4 g32 rule for `weight`, dequantized in float64: (q - 8) scale + zero."""
    from torchao.quantization.quant_primitives import (
        MappingType, _choose_qparams_affine_tinygemm, _quantize_affine_tinygemm,
    )

    n, k = weight.shape
    scale, zero = _choose_qparams_affine_tinygemm(weight, MappingType.ASYMMETRIC, [1, 32], torch.int32, 0, 15, 1e-6,
                                                  None, weight.dtype)
    q = _quantize_affine_tinygemm(weight, [1, 32], scale, zero, torch.int32, 0, 15).double().reshape(n, -1, 32)
    return ((q - 8) * scale.double().reshape(n, -1, 1) + zero.double().reshape(n, -1, 1)).reshape(n, k)


@pytest.mark.parametrize("n,k", [(96, 64), (130, 160), (7, 32)])  # tails: rows not a multiple of 4, K % 256 != 0
def test_int4_product_is_the_dequantized_weights_product(ops, n, k):
    from specdec.quant.native import pack_int4

    torch.manual_seed(n)
    weight = (torch.randn(n, k) * 0.05).bfloat16()
    nibbles, scales = pack_int4(weight)
    x = torch.randn(9, k).bfloat16()
    exact = x.double() @ _dequantized(weight).T
    got = ops.int4_mm(x, nibbles, scales).double()
    # within bf16 rounding of the result (2^-8 relative), plus float32 sums
    assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * exact.abs().max()).all()
    swapped = ops.int4_mm(x, (nibbles >> 4) | (nibbles << 4), scales).double()  # the other nibble order: far off
    assert (swapped - exact).abs().max() > 10 * (got - exact).abs().max()


def test_int8_product_is_the_scaled_rows_product(ops):
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (203, 96), dtype=torch.int8)
    s = (torch.rand(203) / 50).bfloat16()
    x = torch.randn(6, 96).bfloat16()
    exact = (x.double() @ q.double().T) * s.double()
    got = ops.int8_mm(x, q, s).double()
    assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4 * exact.abs().max()).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_its_batch(ops, threads):
    """Bit for bit: row m of a W-row product is the 1-row product of row m, at any thread count, so a token's
    logits are the same whether a plain step or a wide verification scored it."""
    from specdec.quant.native import pack_int4

    torch.manual_seed(1)
    nibbles, scales = pack_int4((torch.randn(260, 576) * 0.05).bfloat16())
    q8, s8 = torch.randint(-127, 128, (1001, 576), dtype=torch.int8), (torch.rand(1001) / 50).bfloat16()
    x = torch.randn(11, 576).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wide4, wide8 = ops.int4_mm(x, nibbles, scales), ops.int8_mm(x, q8, s8)
    finally:
        torch.set_num_threads(before)
    for m in range(11):
        assert torch.equal(wide4[m], ops.int4_mm(x[m:m + 1], nibbles, scales)[0])
        assert torch.equal(wide8[m], ops.int8_mm(x[m:m + 1], q8, s8)[0])


def test_backend_runs_torchao_int4h8s_weights(tiny):
    from specdec.quant.native import NativeInt4Linear, NativeInt8Rows, NativePart

    reference = quant.quantized_copy(tiny, "torchao_int4h8_g32")
    target = quant.quantized_copy(tiny, "native_int4h8_g32")
    layer = target.model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, NativeInt4Linear) and isinstance(layer.mlp.down_proj, NativeInt4Linear)
    parts = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    assert all(isinstance(p, NativePart) for p in parts) and len({id(p.stacked) for p in parts}) == 1
    x = torch.randn(3, 64).bfloat16()
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        alone = NativeInt4Linear(tiny.model.model.layers[0].get_submodule(name).weight.bfloat16())
        assert torch.equal(layer.get_submodule(name)(x), alone(x))  # stacked = separate, bit for bit
    assert isinstance(target.lm_head, NativeInt8Rows)
    assert torch.equal(target.lm_head.qweight, reference.lm_head.qweight)  # the same int8 table
    ids = torch.tensor([[3, 17, 5, 9, 22, 5, 9, 22]])
    a = reference.model(ids).logits.float()
    b = target.model(ids).logits.float()
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05 * a.abs().max().item())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_the_kernels_are_built_once_into_the_cache(ops):
    from specdec import machine

    built = list((machine.cache_root() / "native").rglob("lowbit-*.so"))
    assert len(built) == 1 and machine.machine_key("cpu") in str(built[0])


def test_generate_on_native_is_exact_with_a_drafter(tiny):
    target = quant.quantized_copy(tiny, "native_int4h8_g32")
    prompt = [3, 17, 5, 9, 22, 5, 9, 22, 5, 9]
    plain = specdec.generate(target, None, prompt, max_new_tokens=16, stop_on_eos=False).token_ids
    drafted = specdec.generate(target, specdec.drafters.build("ngram", target=target), prompt, shape="chain(4)",
                               max_new_tokens=16, stop_on_eos=False).token_ids
    assert drafted == plain


@pytest.mark.slow
def test_compiled_forward_runs_one_product_per_stack(tiny):
    """Traced, q/k/v and gate/up each call the kernel once (`_merge_same_products`): 4 calls a layer, not 7."""
    from torch._inductor import config
    from torch.profiler import profile

    target = quant.quantized_copy(tiny, "native_int4h8_g32")
    ids = torch.tensor([[3, 17, 5, 9]])
    with torch.inference_mode():
        program = torch.compile(target.model, dynamic=False)
        program(ids)
        with profile() as p:
            program(ids)
    calls = sum(e.count for e in p.key_averages() if e.key == "specdec_lowbit::int4_mm")
    assert calls == 4 * len(target.model.model.layers)
    assert config.post_grad_custom_post_pass is not None
