"""The GPTQ reference backend: its defining property against RTN, its spec grammar, end to end."""

import pytest
import torch

import specdec
from specdec import quant
from specdec.quant.gptq_ref import gptq_quantize, layer_hessians
from specdec.loop.reference import reference_generate


def _samples(vocab: int, count: int = 4, length: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


def _output_error(weight, quantized, hessian) -> float:
    """||X W^T - X Q^T||^2 / n up to the factor 2: tr((W - Q) H (W - Q)^T)."""
    d = weight - quantized
    return float(torch.trace(d @ hessian @ d.T))


@pytest.mark.parametrize("bits,group", [(3, 16), (4, 16), (4, None)])
def test_gptq_layer_output_error_is_at_most_rtn(tiny_llama64, bits, group):
    """GPTQ's defining property: on the calibration activations, every layer's output error is no
    larger than round-to-nearest's on the same grid (bits, group size)."""
    hessians = layer_hessians(tiny_llama64.model, _samples(tiny_llama64.vocab_size))
    assert set(hessians) == set(quant.quantizable_linears(tiny_llama64.model))
    for name, h in hessians.items():
        w = tiny_llama64.model.get_submodule(name).weight.detach()
        gptq = _output_error(w, gptq_quantize(w, h, bits, group, symmetric=False), h)
        rtn = _output_error(w, quant.rtn_quantize(w, bits, group, symmetric=False), h)
        assert gptq <= rtn, f"{name}: GPTQ output error {gptq:.3g} > RTN {rtn:.3g} at {bits} bits, group {group}"


def test_gptq_on_identity_hessian_is_rtn():
    """Uncorrelated inputs (H = I, damped or not): U is diagonal, so a column's error moves no other
    column and GPTQ rounds exactly like RTN on the same grid."""
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = quant.rtn_quantize(w, 4, 16, symmetric=True)
    assert torch.equal(gptq_quantize(w, torch.eye(32, dtype=torch.float64), 4, 16, symmetric=True), expected)


def test_gptqref_spec_parsing():
    assert quant.parse_spec("gptqref4").text == "gptqref4_g64"
    assert quant.parse_spec("gptqref3_g32").text == "gptqref3_g32"
    assert quant.parse_spec("gptqref4_pc_sym").text == "gptqref4_pc_sym"
    assert quant.parse_spec("gptq4").backend == "gptq"  # the gptqmodel backend keeps its name
    with pytest.raises(quant.QuantSpecError, match=r"bit-widths \[3, 4\]"):
        quant.parse_spec("gptqref8")
    with pytest.raises(quant.QuantSpecError, match="needs a bit-width"):
        quant.parse_spec("gptqref")
    assert quant.get("gptqref").calibrated and not quant.get("gptqref").packed


def test_bad_inputs():
    with pytest.raises(ValueError, match="does not divide"):
        gptq_quantize(torch.randn(4, 24), torch.eye(24), 4, 16, symmetric=False)
    with pytest.raises(ValueError, match=r"hessian \[I, I\]"):
        gptq_quantize(torch.randn(4, 24), torch.eye(8), 4, None, symmetric=False)
    with pytest.raises(ValueError, match="calibration"):
        layer_hessians(torch.nn.Linear(2, 2), [])


def test_gptqref_target_runs_end_to_end(tiny_llama64):
    """A GPTQ-quantized copy of a tiny target (no tokenizer: calibrated on fixed pseudo-random ids)
    drafts for the fp64 target, and the speculative output stays the target's greedy output."""
    draft = quant.quantized_copy(tiny_llama64, "gptqref4_g16")
    assert draft.quant == "gptqref4_g16" and draft.info["quant"]["calibration"] is not None
    layers = quant.quantizable_linears(draft.model)
    assert all(not torch.equal(draft.model.get_submodule(n).weight, tiny_llama64.model.get_submodule(n).weight)
               for n in layers)
    prompt = [1, 5, 9, 5, 9, 5, 9, 13]
    drafter = specdec.drafters.build("small", target=tiny_llama64, model=draft)
    out = specdec.generate(tiny_llama64, drafter, prompt, shape="chain(3)", max_new_tokens=16, stop_on_eos=False)
    assert out.token_ids == reference_generate(tiny_llama64, prompt, max_new_tokens=16, stop_on_eos=False)
    assert out.stats.mean_acceptance_length > 1.5  # a 4-bit copy of the target agrees with it
