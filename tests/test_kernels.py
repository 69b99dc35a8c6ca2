"""Linear kernels (specdec.runtime.kernels): the packed linear computes F.linear, the swap is reversible and
shares weights, `auto` is measured once and cached, bad kernels are refused before any work, and
greedy speculation stays exact for every drafter on a target whose linears are packed."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import specdec
from specdec import machine
from specdec import certify
from specdec.runtime import kernels
from specdec.drafters import build_for_tests
from specdec.quant import quantized_copy

ONEDNN = kernels.why_not("onednn", "cpu", torch.float32)
needs_onednn = pytest.mark.skipif(ONEDNN is not None, reason=f"oneDNN kernel unavailable: {ONEDNN}")
ONEDNN_BF16 = kernels.why_not("onednn", "cpu", torch.bfloat16)  # AVX2-only CPUs: refused
needs_onednn_bf16 = pytest.mark.skipif(ONEDNN_BF16 is not None, reason=f"oneDNN bf16 unavailable: {ONEDNN_BF16}")


@pytest.fixture()
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    return tmp_path / "kernels"


def _packed_tiny(family="llama", dtype=torch.float32, seed=0, kernel="onednn"):
    return kernels.use_kernel(specdec.tiny_target(family, vocab_size=64, dtype=dtype, seed=seed, logit_scale=4.0),
                              kernel)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (1, 7, 48), (2, 3, 48)])
def test_onednn_linear_computes_f_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = kernels.OneDNNLinear(linear)
    x = torch.randn(*shape)
    want = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    got = packed(x)
    assert got.shape == (*shape[:-1], 80) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # a kernel that skipped the bias, or multiplied by the untransposed weight, is caught
    assert bias is False or (got.double() - (want - linear.bias.double())).abs().max() > 1e-3


@needs_onednn_bf16
def test_onednn_linear_computes_f_linear_in_bfloat16():
    torch.manual_seed(0)
    linear = nn.Linear(48, 80).bfloat16()
    xb, lb = torch.randn(5, 48).bfloat16(), kernels.OneDNNLinear(linear)
    torch.testing.assert_close(lb(xb).float(), F.linear(xb, lb.weight, lb.bias).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_a_dtype_onednn_refuses_on_this_cpu_is_left_as_loaded(monkeypatch):
    """oneDNN packs bf16 only with AVX-512 / AVX-NE-CONVERT: the probe is per dtype, so on an AVX2-only CPU
    a bf16 model keeps its nn.Linears (an EAGLE head cast to bf16 then drafts by F.linear), an explicit
    onednn kernel for a bf16 target is refused naming why, and float32 is still packed."""
    monkeypatch.setitem(kernels._PROBED, ("onednn", torch.bfloat16), "no bf16 conversion instructions (test)")
    monkeypatch.setitem(kernels._PROBED, ("hybrid", torch.bfloat16), "no bf16 conversion instructions (test)")
    model = nn.Sequential(nn.Linear(8, 8).bfloat16(), nn.Linear(8, 8))
    assert kernels.apply_kernel(model, "onednn") == 1
    assert [type(m) for m in model] == [nn.Linear, kernels.OneDNNLinear]
    assert kernels.linear_over(torch.ones(4, 8, dtype=torch.bfloat16), "onednn") is None
    assert kernels.candidates("cpu", torch.bfloat16) == ["torch"]
    with pytest.raises(ValueError, match="kernel='onednn' cannot run here: no bf16 conversion instructions"):
        kernels.use_kernel(specdec.tiny_target("llama", vocab_size=64, dtype=torch.bfloat16), "onednn")
    with pytest.raises(ValueError, match="cannot become torch.bfloat16.*no bf16 conversion"):
        model[1].bfloat16()
    target = _packed_tiny(seed=4)
    drafter = specdec.drafters.build("eagle", target=target, head="random", draft_vocab=24, head_dtype="bfloat16")
    head_linears = [m for m in drafter.head.modules() if isinstance(m, nn.Linear | kernels.OneDNNLinear)]
    assert head_linears and all(type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 for m in head_linears)
    assert certify.greedy_case(target, drafter, "chain(4)", max_new_tokens=12) is None


@needs_onednn
def test_hybrid_runs_one_row_by_f_linear_and_wider_products_by_onednn():
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    hybrid, packed = kernels.OneDNNLinear(linear, plain_one_row=True), kernels.OneDNNLinear(linear)
    for shape in [(48,), (1, 48), (1, 1, 48)]:  # one row: exactly transformers' own product
        x = torch.randn(*shape)
        assert torch.equal(hybrid(x), F.linear(x, linear.weight, linear.bias))
    for shape in [(2, 48), (1, 5, 48), (3, 1, 48)]:  # several rows: exactly the packed product
        x = torch.randn(*shape)
        assert torch.equal(hybrid(x), packed(x))
    model = _packed_tiny(kernel="hybrid").model
    n = sum(isinstance(m, kernels.OneDNNLinear) for m in model.modules())
    assert n > 0 and kernels.kernel_in_use(model) == "hybrid"
    assert kernels.kernel_in_use(copy.deepcopy(model)) == "hybrid"
    packs = [m.packed for m in model.modules() if isinstance(m, kernels.OneDNNLinear)]
    assert kernels.apply_kernel(model, "onednn") == 0 and kernels.kernel_in_use(model) == "onednn"  # no repacking
    assert [m.packed for m in model.modules() if isinstance(m, kernels.OneDNNLinear)] == packs
    assert kernels.apply_kernel(model, "hybrid") == 0 and kernels.kernel_in_use(model) == "hybrid"


@needs_onednn
def test_apply_kernel_swaps_plain_linears_only_and_round_trips():
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=0)
    model = target.model
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    assert kernels.apply_kernel(model, "onednn") == len(plain) > 0
    assert all(isinstance(model.get_submodule(n), kernels.OneDNNLinear) for n in plain)
    assert kernels.kernel_in_use(model) == "onednn"
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights  # shared, not copied
    assert set(model.state_dict()) == keys
    assert kernels.apply_kernel(model, "onednn") == 0  # nothing plain is left to pack
    assert kernels.apply_kernel(model, "torch") == len(plain)
    assert all(type(model.get_submodule(n)) is nn.Linear for n in plain)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights


def test_kernels_leave_other_dtypes_and_linear_subclasses_alone():
    class Special(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8).double(), Special(8, 8), nn.Linear(8, 8).half())
    assert kernels.apply_kernel(model, "onednn") == 0
    assert [type(m) for m in model] == [nn.Linear, Special, nn.Linear]


@needs_onednn
def test_a_deep_copy_of_a_packed_model_is_packed_over_copied_weights():
    target = _packed_tiny()
    clone = copy.deepcopy(target.model)
    x = torch.tensor([[1, 5, 9]])
    torch.testing.assert_close(clone(x).logits, target.model(x).logits)
    pairs = [(a, b) for a, b in zip(target.model.modules(), clone.modules()) if isinstance(a, kernels.OneDNNLinear)]
    assert pairs and all(isinstance(b, kernels.OneDNNLinear) and b.weight is not a.weight for a, b in pairs)
    with torch.no_grad():
        pairs[0][1].weight.zero_()  # the copy's weights are its own
    assert pairs[0][0].weight.abs().sum() > 0


@needs_onednn
def test_casting_a_packed_model_packs_the_cast_weights():
    target = _packed_tiny(seed=2)
    x = torch.tensor([[1, 5, 9]])
    with kernels.plain_linears(target.model) as plain:
        want = copy.deepcopy(plain).bfloat16()(x).logits
    if ONEDNN_BF16 is not None:  # this CPU packs float32 only: the cast is refused, naming why
        with pytest.raises(ValueError, match="cannot become torch.bfloat16"):
            target.model.bfloat16()
        return
    target.model.bfloat16()
    assert kernels.kernel_in_use(target.model) == "onednn"
    torch.testing.assert_close(target.model(x).logits, want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="cannot become torch.float16"):
        target.model.half()


@needs_onednn
def test_plain_linears_restores_the_packed_modules():
    target = _packed_tiny()
    packed = {n: m for n, m in target.model.named_modules() if isinstance(m, kernels.OneDNNLinear)}
    with kernels.plain_linears(target.model) as model:
        assert kernels.kernel_in_use(model) == "torch"
        assert all(model.get_submodule(n).weight is m.weight for n, m in packed.items())
    assert all(target.model.get_submodule(n) is m for n, m in packed.items())


def test_auto_takes_the_only_kernel_without_measuring(kernel_cache):
    target = kernels.use_kernel(specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64), "auto")
    assert target.kernel == "torch" and target.info["kernel"] == {
        "requested": "auto", "kernel": "torch", "description": kernels.KERNELS["torch"].description}
    assert not kernel_cache.parent.joinpath("tune").exists()


@needs_onednn
def test_auto_looks_the_choice_up_and_never_measures(kernel_cache, monkeypatch):
    """`auto` with several kernels: the stored choice (python -m specdec.tune), else the fixed default;
    `measure_choice` is what tune runs, and picks the least total time."""
    def no_measurement(*args, **kwargs):
        raise AssertionError("a constructor measured")

    tiny = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32)
    choice = kernels.measure_choice(tiny, kernels.candidates("cpu", torch.float32), repeats=1)
    assert set(choice["seconds"]) == {"torch", "onednn", "hybrid"}
    assert choice["kernel"] == kernels.pick({k: {int(w): s for w, s in v.items()} for k, v in choice["seconds"].items()})
    monkeypatch.setattr(kernels, "measure_choice", no_measurement)
    untuned = specdec.load_target("tiny-llama")
    assert untuned.kernel == machine.DEFAULT_KERNEL and untuned.info["kernel"]["tuned"] is False
    for stored in ("onednn", "hybrid", "torch"):
        machine.update_record("tiny-llama", "cpu", torch.float32, kernel={**choice, "kernel": stored})
        target = specdec.load_target("tiny-llama")
        assert target.kernel == stored == kernels.kernel_in_use(target.model) and target.info["kernel"]["tuned"]


def test_pick_takes_the_least_total_time():
    assert kernels.pick({"torch": {1: 1.0, 8: 3.0}, "onednn": {1: 1.2, 8: 2.0}}) == "onednn"
    assert kernels.pick({"torch": {1: 1.0, 8: 2.0}, "onednn": {1: 1.2, 8: 2.0}}) == "torch"


def test_bad_kernels_are_refused_before_any_work():
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl'.*auto, torch, onednn"):
        specdec.load_target("no/such/model", kernel="mkl")  # refused before the (failing) load
    with pytest.raises(ValueError, match="kernel='onednn' cannot run here.*not torch.float64"):
        kernels.use_kernel(specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64), "onednn")
    with pytest.raises(ValueError, match="runs on cpu only, not on cuda"):
        kernels.resolve("onednn", "cuda", torch.float32)


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "hybrid"])
@pytest.mark.parametrize("name", specdec.drafters.names())
def test_greedy_speculation_is_exact_with_packed_linears(name, kernel):
    target = _packed_tiny(kernel=kernel)
    drafter = build_for_tests(name, target=target)
    for shape in ("chain(4)", "tree(3,2,2)"):
        divergence = certify.greedy_case(target, drafter, shape, max_new_tokens=16)
        assert divergence is None, f"{name} diverged from greedy with the {kernel} kernel: {divergence}"


@needs_onednn
def test_packed_and_plain_kernels_agree_on_the_same_weights():
    packed = _packed_tiny(seed=3)
    plain = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=3, logit_scale=4.0)
    prompt = certify.GREEDY_PROMPTS[0]
    a = specdec.generate(packed, None, list(prompt), max_new_tokens=16, stop_on_eos=False).token_ids
    b = specdec.generate(plain, None, list(prompt), max_new_tokens=16, stop_on_eos=False).token_ids
    assert a == b


@needs_onednn
def test_quantizing_a_packed_target_unpacks_quantizes_and_packs_again():
    target = _packed_tiny()
    prompt = list(certify.GREEDY_PROMPTS[1])
    before = specdec.generate(target, None, prompt, max_new_tokens=12, stop_on_eos=False).token_ids
    copy8 = quantized_copy(target, "rtn8_pc")
    assert copy8.kernel == "onednn" and copy8.quant == "rtn8_pc"
    assert kernels.kernel_in_use(copy8.model) == "onednn"
    original = {n: m.weight for n, m in target.model.named_modules() if isinstance(m, kernels.OneDNNLinear)}
    copied = {n: m.weight for n, m in copy8.model.named_modules() if isinstance(m, kernels.OneDNNLinear)}
    assert set(copied) == set(original) and all(copied[n] is not original[n] for n in original)
    assert any(not torch.equal(copied[n], original[n]) for n in original)  # the copy's weights were rounded
    assert specdec.generate(target, None, prompt, max_new_tokens=12, stop_on_eos=False).token_ids == before
    with pytest.raises(specdec.quant.QuantSpecError, match="does not divide"):  # layers are seen through the packing
        specdec.quant.check_quantizable(target, "rtn4_g48")
    with pytest.raises(ValueError, match="packed for the onednn kernel"):  # never a silently skipped layer
        specdec.quant.get("rtn").apply(target.model, specdec.quant.parse_spec("rtn4_g32"))
    quantized = specdec.quant.quantize_target(target, "rtn4_g32")
    assert quantized.kernel == "onednn" and quantized.info["quant"]["layers_quantized"] > 0


@needs_onednn
def test_eagle_packs_a_copy_of_its_head():
    target = _packed_tiny()
    head = specdec.drafters.eagle.random_head(target)
    drafter = specdec.drafters.build("eagle", target=target, head=head, draft_vocab=20, head_dtype=None)
    assert isinstance(drafter.head.fc, kernels.OneDNNLinear) and drafter.scorer is not None
    assert type(head.fc) is nn.Linear  # the caller's head can still be trained
    assert certify.greedy_case(target, drafter, "chain(4)", max_new_tokens=12) is None
