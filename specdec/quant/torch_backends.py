"""Backends built on torch and torchao kernels: `torchao_int4` (CPU tinygemm, the model cast to bf16), `torchao_int8`
(per-row scales), `torchao_w8a8` (int8 weights x dynamic int8 activations), `dynamic_int8` and `dynamic_fp16` (torch
`quantize_dynamic`, CPU only). Knows which layers to touch only through `quantizable_linears`.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specdec.quant.layers import quantizable_linears
from specdec.quant.registry import QuantSpec, backend


def _only(model: nn.Module):
    """A torchao `filter_fn` that accepts exactly the quantizable linears of `model`."""
    names = set(quantizable_linears(model))
    return lambda module, fqn: fqn in names


def _int4_cpu_probe() -> str | None:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch build lacks aten._weight_int4pack_mm_for_cpu (torchao's CPU int4 kernel)"
    return None


@backend("torchao_int4",
         description="torchao int4 weight-only (CPU tinygemm layout), bf16 weights+activations elsewhere",
         bits=(4,), grouped=True, group_sizes=(32, 64, 128), devices=("cpu",), library="torchao", extra="torchao",
         probe=_int4_cpu_probe)
def apply_torchao_int4(model: nn.Module, spec: QuantSpec) -> nn.Module:
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    model = model.to(torch.bfloat16)  # the CPU int4 kernel takes bf16 activations
    quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=spec.group_size), filter_fn=_only(model))
    return model


@backend("torchao_int8", description="torchao int8 weight-only, per-row scales, model dtype activations",
         bits=(8,), library="torchao", extra="torchao")
def apply_torchao_int8(model: nn.Module, spec: QuantSpec) -> nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig(), filter_fn=_only(model))
    return model


@backend("torchao_w8a8", description="torchao int8 weights (per row) x int8 activations (per token, quantized each "
         "forward); compiled (cache='compiled'), inductor runs int8 GEMMs",
         bits=(8,), library="torchao", extra="torchao")
def apply_torchao_w8a8(model: nn.Module, spec: QuantSpec) -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig(), filter_fn=_only(model))
    return model


def _quantize_dynamic(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    from torch.ao.quantization import default_dynamic_qconfig, float16_dynamic_qconfig

    qconfig = default_dynamic_qconfig if dtype == torch.qint8 else float16_dynamic_qconfig
    with warnings.catch_warnings():  # quantize_dynamic is deprecated in favour of torchao; we use it knowingly
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return torch.ao.quantization.quantize_dynamic(
            model, {name: qconfig for name in quantizable_linears(model)}, dtype=dtype, inplace=True)


@backend("dynamic_int8", description="torch quantize_dynamic: int8 weights (per tensor), int8 activations per forward",
         bits=(8,), devices=("cpu",), dtypes=(torch.float32,))
def apply_dynamic_int8(model: nn.Module, spec: QuantSpec) -> nn.Module:
    return _quantize_dynamic(model, torch.qint8)


@backend("dynamic_fp16", description="torch quantize_dynamic with fp16 weights, fp32 activations",
         bits=(16,), devices=("cpu",), dtypes=(torch.float32,), nominal_bits=lambda spec: 16.0)
def apply_dynamic_fp16(model: nn.Module, spec: QuantSpec) -> nn.Module:
    return _quantize_dynamic(model, torch.float16)
