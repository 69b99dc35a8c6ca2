"""Quantized targets: the registry, RTN's numerics, every backend, exactness, bad input.

- RTN: 8 bits is close to the original (mean KL < 1e-4 on a tiny model, < 1e-3 on the embedded one),
  error grows as bits fall, group size / per-channel / symmetric do what they say;
- every registered backend either quantizes and runs a tiny model here or reports why not (naming the
  pip extra when its library is missing), and greedy speculative output equals the *quantized*
  target's cacheless greedy output;
- adapters of backends that cannot run here (GPTQ; bitsandbytes where absent) are tested without
  their kernels: argument mapping, calibration set, layout checks;
- bad input: unknown names, bits or group sizes a backend does not support, a group size that does
  not divide a layer, a device the kernels do not support, a missing library.
"""

from unittest import mock

import pytest
import torch

import specdec
from specdec import quant
from specdec.quant import registry
from specdec.quant.bnb_backend import bnb_linear_kwargs, check_cpu_4bit_rows
from specdec.quant.gptq_backend import gptq_calibration, gptq_config
from specdec.quant.hqq_backend import hqq_config
from specdec.quant.texts import CALIBRATION_PARAGRAPHS
from specdec.loop.reference import reference_generate

SPECS = quant.example_specs()
PROMPT = [1, 5, 9, 5, 9, 5, 9, 13]


@pytest.fixture(scope="module")
def tiny():
    """fp32 llama, hidden 64: every layer width divides 32 and every output width is a multiple of 32
    (bitsandbytes' CPU 4-bit layout)."""
    return specdec.tiny_target("llama", vocab_size=64, hidden_size=64, dtype=torch.float32, seed=0, logit_scale=4.0)


def _kl(reference, quantized):
    return quant.quant_report(reference, quantized, quant.ReportConfig(latency=False, eval_tokens=128))


# ---- spec strings --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, canonical", [
    ("rtn4", "rtn4_g64"), ("rtn3_g64_sym", "rtn3_g64_sym"), ("RTN8_pc", "rtn8_pc"), ("rtn2_g16_asym", "rtn2_g16"),
    ("bf16", "bf16"), ("none", "none"), ("torchao_int4_g64", "torchao_int4_g64"), ("hqq3", "hqq3_g32"),
    ("gptq4", "gptq4_g32"), ("gptq4_asym", "gptq4_g32_asym"), ("bnb_nf4", "bnb_nf4_g32"),
])
def test_spec_canonical_text(text, canonical):
    assert quant.parse_spec(text).text == canonical
    assert quant.parse_spec(canonical) == quant.parse_spec(text)


@pytest.mark.parametrize("text, message", [
    ("rtn9", "bit-widths"), ("rtn1", "bit-widths"), ("hqq5", "bit-widths"), ("gptq6", "bit-widths"),
    ("rtn", "needs a bit-width"), ("int4", "names no registered backend"), ("rtn4_x", "unknown option"),
    ("torchao_int4_g16", "group sizes"), ("bf16_g32", "takes no group size"), ("torchao_int8_sym", "no symmetric"),
    ("torchao_int4_pc", "no per-channel"), ("rtn4g32", "cannot parse"), ("", "non-empty"),
])
def test_bad_specs_are_clear_errors(text, message):
    with pytest.raises(quant.QuantSpecError, match=message):
        quant.parse_spec(text)


# ---- RTN numerics --------------------------------------------------------------------------------


def test_rtn_8bit_is_close_to_the_original(tiny):
    report = _kl(tiny, quant.quantized_copy(tiny, "rtn8_g32"))
    assert report["mean_kl"] < 1e-4
    assert report["top1_agreement"] >= 0.98


def test_rtn_error_grows_as_bits_fall(tiny):
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    errors = [float((quant.rtn_quantize(weight, b, 32, False) - weight).pow(2).mean()) for b in range(2, 9)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 1000
    kls = [_kl(tiny, quant.quantized_copy(tiny, f"rtn{b}_g32"))["mean_kl"] for b in (2, 4, 8)]
    assert kls[0] > kls[1] > kls[2]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [16, 64, None])
def test_rtn_groups_hold_at_most_2_to_the_bits_levels(bits, group):
    weight = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    out = quant.rtn_quantize(weight, bits, group, symmetric=False)
    groups = out.reshape(8, -1, group or 128)
    for row in groups.reshape(-1, groups.shape[-1]):
        assert row.unique().numel() <= 2**bits
    # asymmetric: every group's min and max are reproduced (exactly up to float rounding)
    original = weight.reshape(8, -1, group or 128)
    torch.testing.assert_close(groups.amin(-1), original.amin(-1))
    torch.testing.assert_close(groups.amax(-1), original.amax(-1))


def test_rtn_smaller_groups_are_more_accurate():
    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    errors = [float((quant.rtn_quantize(weight, 4, g, False) - weight).pow(2).mean()) for g in (16, 64, 256, None)]
    assert errors[0] < errors[1] < errors[2] == errors[3]  # per-channel = one group of the whole row


def test_rtn_symmetric_is_zero_centred_multiples_of_one_scale():
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) + 0.5  # skewed: asym != sym
    weight[0, 0] = 0.0
    sym = quant.rtn_quantize(weight, 4, 32, symmetric=True)
    groups, original = sym.reshape(4, 2, 32), weight.reshape(4, 2, 32)
    scale = original.abs().amax(-1, keepdim=True) / 7  # 4 bits: q in -8..7, scale = max|w| / 7
    q = groups / scale
    torch.testing.assert_close(q, q.round())
    assert int(q.round().max()) <= 7 and int(q.round().min()) >= -8
    assert sym[0, 0] == 0.0  # zero is exact
    assert not torch.equal(sym, quant.rtn_quantize(weight, 4, 32, symmetric=False))


def test_rtn_keeps_the_weight_dtype_and_rejects_bad_arguments():
    weight = torch.randn(4, 64, dtype=torch.float64)
    assert quant.rtn_quantize(weight, 4, 32, False).dtype == torch.float64
    with pytest.raises(ValueError, match="does not divide"):
        quant.rtn_quantize(weight, 4, 48, False)
    with pytest.raises(ValueError, match="2..8 bits"):
        quant.rtn_quantize(weight, 1, 32, False)


# ---- every backend -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_every_backend_runs_here_or_says_why_not(tiny, spec):
    available = quant.availability(spec, tiny.device)
    if not available.ok:
        assert available.reasons and all(r.strip() for r in available.reasons)
        b = quant.get(quant.parse_spec(spec).backend)
        if b.library and "not importable" in available.reason:
            assert f"pip install 'specdec[{b.extra}]'" in available.reason
        with pytest.raises(quant.BackendUnavailableError, match="cannot quantize"):
            quant.quantized_copy(tiny, spec)
        return
    quantized = quant.quantized_copy(tiny, spec)
    logits = quantized.forward(torch.tensor([PROMPT]), specdec.runtime.cache.KVCache()).logits
    assert logits.shape == (1, len(PROMPT), tiny.vocab_size) and torch.isfinite(logits.float()).all()
    info = quantized.info["quant"]
    assert info["spec"] == quant.parse_spec(spec).text and quantized.quant == info["spec"]
    assert info["weight_bytes"] > 0 and info["bits_per_param"] > 0


@pytest.mark.parametrize("spec", [s for s in SPECS if quant.availability(s).ok] + ["rtn3_g16_sym"])
@pytest.mark.parametrize("shape", ["chain(4)", "tree(3,2,2)"])
def test_greedy_output_equals_the_quantized_targets_reference(tiny, spec, shape):
    target = quant.quantized_copy(tiny, spec)
    reference = reference_generate(target, PROMPT, max_new_tokens=16, stop_on_eos=False)
    for drafter in (specdec.drafters.build("ngram", target=target),
                    specdec.drafters.build("small", target=target, layers=1)):
        out = specdec.generate(target, drafter, PROMPT, shape=shape, max_new_tokens=16, stop_on_eos=False)
        assert out.token_ids == reference, f"{spec} {shape} {drafter.name} diverged from the quantized greedy"


def test_quantized_copy_leaves_the_original_untouched(tiny):
    before = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    copy = quant.quantized_copy(tiny, "rtn2_g32")
    assert all(torch.equal(before[k], v) for k, v in tiny.model.state_dict().items())
    assert "quant" not in tiny.info and copy.info["quant"]["spec"] == "rtn2_g32"
    assert not torch.equal(copy.model.model.layers[0].mlp.up_proj.weight, tiny.model.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(copy.lm_head.weight, tiny.lm_head.weight)  # the lm_head is never quantized


def test_load_target_takes_a_quant_spec():
    target = specdec.load_target("tiny-llama", quant="rtn4_pc")
    assert target.info["quant"]["spec"] == "rtn4_pc" and target.info["quant"]["nominal_bits_per_quantized_weight"] == 4


def test_report_has_bytes_agreement_kl_and_latency_ratios(tiny):
    quantized = quant.quantized_copy(tiny, "bf16")
    config = quant.ReportConfig(widths=(1, 4), contexts=(8, 16), repeats=2, eval_tokens=64)
    report = quant.quant_report(tiny, quantized, config)
    info = report["quant"]
    assert info["bits_per_param"] == 16 and info["weight_bytes_before"] == 2 * info["weight_bytes"]
    assert 0 <= report["top1_agreement"] <= 1 and report["mean_kl"] >= 0 and report["positions"] == 64
    latency = report["latency"]
    assert latency["widths"] == [1, 4] and len(latency["ratio"]) == 2
    assert all(r > 0 for row in latency["ratio"] for r in row)
    assert report["confounds"] == []  # the Q4_1 note is for the embedded model only


# ---- bad input -----------------------------------------------------------------------------------


def test_group_size_that_does_not_divide_a_layer_is_an_error(tiny):
    with pytest.raises(quant.QuantSpecError, match=r"group size 48 does not divide .* \(64\).*\[32, 64\]"):
        quant.quantized_copy(tiny, "rtn4_g48")
    narrow = specdec.tiny_target("llama", vocab_size=64, hidden_size=32)
    with pytest.raises(quant.QuantSpecError, match="does not divide"):
        quant.quantized_copy(narrow, "hqq4_g64")


def test_unsupported_device_is_reported():
    assert not quant.availability("dynamic_int8", "cuda").ok
    assert "cpu only, not on cuda" in quant.availability("dynamic_int8", "cuda").reason
    assert "cuda only, not on cpu" in quant.availability("gptq4", "cpu").reason


def test_quantizing_on_an_unsupported_device_raises(tiny):
    with pytest.raises(quant.BackendUnavailableError, match="gptq runs on cuda only"):
        quant.quantize_target(tiny, "gptq4")


def test_missing_library_names_the_pip_extra(monkeypatch, tiny):
    fake = registry.Backend(name="fakelib", apply=lambda model, spec: model, description="test only",
                            bits=(4,), library="specdec_no_such_library", extra="fake")
    monkeypatch.setitem(registry._REGISTRY, "fakelib", fake)
    reason = quant.availability("fakelib").reason
    assert "specdec_no_such_library" in reason and "pip install 'specdec[fake]'" in reason
    with pytest.raises(quant.BackendUnavailableError, match=r"specdec\[fake\]"):
        quant.quantized_copy(tiny, "fakelib")


def test_requantizing_a_packed_target_is_an_error(tiny):
    with pytest.raises(quant.QuantSpecError, match="already quantized"):
        quant.quantized_copy(quant.quantized_copy(tiny, "bf16"), "rtn8_g32")


def test_an_rtn_target_can_be_quantized_again(tiny):
    """rtn weights are plain dequantized floats, so a low-bit copy of an rtn target is well defined."""
    rtn4 = quant.quantized_copy(tiny, "rtn4_g32")
    twice = quant.quantized_copy(rtn4, "rtn2_g32")
    assert twice.info["quant"]["on_top_of"] == "rtn4_g32" and twice.info["quant"]["spec"] == "rtn2_g32"
    w4 = rtn4.model.model.layers[0].mlp.up_proj.weight
    w2 = twice.model.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(w4, w2)


def test_a_backend_that_skips_layers_is_an_error(monkeypatch, tiny):
    lazy = registry.Backend(name="lazy", apply=lambda model, spec: model, description="test only", bits=(4,))
    monkeypatch.setitem(registry._REGISTRY, "lazy", lazy)
    with pytest.raises(RuntimeError, match="left 14 of 14 layers unquantized"):
        quant.quantized_copy(tiny, "lazy")


@pytest.mark.skipif(not quant.availability("torchao_int4").ok, reason="torchao int4 unavailable here")
def test_packed_weight_bytes_are_measured(tiny):
    info = quant.quantized_copy(tiny, "torchao_int4_g32").info["quant"]
    assert info["bits_per_quantized_weight"] == 4 + 2 * 16 / 32  # int4 + bf16 scale and zero per 32
    assert info["weight_bytes"] < info["weight_bytes_before"] / 4


@pytest.mark.skipif(not quant.availability("torchao_int4").ok, reason="torchao int4 unavailable here")
def test_int4_linear_is_torchaos_kernel_call_without_the_subclass():
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_
    from specdec.quant.torch_backends import Int4Linear

    linear = torch.nn.Linear(64, 96, bias=False).bfloat16()
    quantize_(linear, PrototypeInt4WeightOnlyConfig(group_size=32))
    x = torch.randn(3, 5, 64).bfloat16()
    assert torch.equal(Int4Linear(linear.weight)(x), linear(x))  # bit for bit: the same aten op on the same tensors


@pytest.mark.skipif(not quant.availability("torchao_int4h8").ok, reason="torchao int4 unavailable here")
@pytest.mark.parametrize("tied", [False, True])
def test_int4h8_stores_the_embedding_and_head_as_int8_rows(tiny, tied):
    import copy
    from specdec.quant.torch_backends import Int8Rows

    source = copy.deepcopy(tiny)
    if tied:
        source.model.lm_head.weight = source.model.model.embed_tokens.weight
    table = source.model.lm_head.weight.detach().bfloat16().float()
    int4 = quant.quantized_copy(source, "torchao_int4_g32")
    target = quant.quantized_copy(source, "torchao_int4h8_g32")
    embed, head = target.model.get_input_embeddings(), target.lm_head
    assert isinstance(embed, Int8Rows) and isinstance(head, Int8Rows) and (embed is head) == tied
    step = head.scale.float()[:, None]  # each entry within a step of its original (half, plus bf16 rounding)
    assert ((head.weight.float() - table).abs() <= step + 1e-6).all()
    ids = torch.tensor([[3, 7, 7, 60]])
    assert torch.equal(embed(ids), embed.weight[ids])  # a lookup is the dequantized row
    x = torch.randn(1, 4, tiny.hidden_size).bfloat16()
    torch.testing.assert_close(head(x).float(), (x.float() @ head.weight.float().T), rtol=2e-2, atol=2e-2)
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):  # traced, one row: a reduction
        torch.testing.assert_close(head(x[:, :1]).float(), head(x)[:, :1].float(), rtol=2e-2, atol=2e-2)
    assert target.info["quant"]["weight_bytes"] < int4.info["quant"]["weight_bytes"]
    assert (target.dtype, target.vocab_size, target.hidden_size) == (torch.bfloat16, tiny.vocab_size, tiny.hidden_size)


def test_wrong_model_dtype_is_an_error():
    fp64 = specdec.tiny_target("llama", vocab_size=64, hidden_size=64, dtype=torch.float64)
    with pytest.raises(quant.QuantSpecError, match="float64"):
        quant.quantized_copy(fp64, "dynamic_int8")


# ---- adapters without their kernels ----------------------------------------------------------------


def test_gptq_adapter_arguments_and_calibration_set():
    assert gptq_config(quant.parse_spec("gptq4")) == {"bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    per_channel = gptq_config(quant.parse_spec("gptq3_pc_asym"))
    assert per_channel == {"bits": 3, "group_size": -1, "sym": False, "desc_act": False}
    tokenizer = specdec.loading.ByteTokenizer()
    examples = gptq_calibration(tokenizer, max_tokens=64)
    assert len(examples) == len(CALIBRATION_PARAGRAPHS) >= 8
    assert all(len(e["input_ids"]) == len(e["attention_mask"]) == 64 for e in examples)
    assert examples == gptq_calibration(tokenizer, max_tokens=64)  # fixed
    assert quant.get("gptq").calibrated and quant.get("gptq").devices == ("cuda",)


def test_bnb_adapter_arguments_and_cpu_layout_check():
    linear = torch.nn.Linear(64, 48, bias=False)
    nf4 = bnb_linear_kwargs(quant.parse_spec("bnb_nf4_g64"), linear)
    assert nf4["quant_type"] == "nf4" and nf4["compute_dtype"] == torch.float32 and nf4["output_features"] == 48
    assert bnb_linear_kwargs(quant.parse_spec("bnb_int8"), linear)["threshold"] == 6.0
    narrow = specdec.tiny_target("llama", vocab_size=64, hidden_size=32)  # k_proj has 16 output rows
    with pytest.raises(quant.QuantSpecError, match="multiples of 32"):
        check_cpu_4bit_rows(narrow.model, quant.parse_spec("bnb_nf4"), repacks=True)
    check_cpu_4bit_rows(narrow.model, quant.parse_spec("bnb_nf4"), repacks=False)
    check_cpu_4bit_rows(narrow.model, quant.parse_spec("bnb_int8"), repacks=True)


def test_hqq_adapter_arguments():
    assert hqq_config(quant.parse_spec("hqq3_g64")) == {"nbits": 3, "group_size": 64, "axis": 1}
    with pytest.raises(quant.QuantSpecError, match="group sizes"):
        quant.parse_spec("hqq4_g12")


# ---- the embedded model (one test) ---------------------------------------------------------------


@pytest.mark.slow
def test_embedded_rtn8_is_close_and_g128_is_rejected(embedded):
    report = _kl(embedded, quant.quantized_copy(embedded, "rtn8_g32"))
    assert report["mean_kl"] < 1e-3 and report["top1_agreement"] >= 0.98
    assert report["confounds"] and "Q4_1" in report["confounds"][0]
    for spec in ("rtn4_g128", "torchao_int4_g128", "hqq4_g128"):  # torchao alone would skip layers silently
        with pytest.raises(quant.QuantSpecError, match=r"does not divide .*\(576\).*\[32, 64\]"):
            quant.check_quantizable(embedded, spec)
