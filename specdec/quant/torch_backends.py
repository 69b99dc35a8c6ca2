"""Backends built on torch and torchao kernels: `torchao_int4` (CPU tinygemm, the model cast to bf16), `torchao_int4h8`
(the same, with the embedding and lm_head in int8 rows: the layout of the embedded GGUF, Q4_1 body and Q8_0
table), `torchao_int8` (per-row scales), `torchao_w8a8` (int8 weights x dynamic int8 activations), `dynamic_int8` and
`dynamic_fp16` (torch `quantize_dynamic`, CPU only). Owns `Int4Linear` and `Int8Rows`, two plain modules over packed
tensors. Knows which layers to touch only through `quantizable_linears`.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specdec.quant.layers import quantizable_linears, replace_linears
from specdec.quant.registry import QuantSpec, backend


def _only(model: nn.Module):
    """A torchao `filter_fn` that accepts exactly the quantizable linears of `model`."""
    names = set(quantizable_linears(model))
    return lambda module, fqn: fqn in names


def _int4_cpu_probe() -> str | None:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch build lacks aten._weight_int4pack_mm_for_cpu (torchao's CPU int4 kernel)"
    return None


class Int4Linear(nn.Module):
    """A bias-free linear over torchao's CPU int4 packing (tinygemm layout, per-group scale and zero), as plain
    tensors: the same kernel call torchao's `Int4OpaqueTensor` makes, without the tensor subclass, whose guards a
    compiled forward checks in Python, one per layer, every step."""

    def __init__(self, weight) -> None:  # weight: a torchao Int4OpaqueTensor of a [out, in] weight
        super().__init__()
        self.qdata = nn.Parameter(weight.qdata, requires_grad=False)  # [out, in / 2] uint8
        self.scale_and_zero = nn.Parameter(weight.scale_and_zero, requires_grad=False)  # [in / group, out, 2]
        self.group_size, (self.out_features, self.in_features) = weight.block_size[1], weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).contiguous(), self.qdata,
                                                        self.group_size, self.scale_and_zero)
        return y[:, :self.out_features].reshape(*x.shape[:-1], self.out_features)


class Int8Rows(nn.Module):
    """An embedding, an lm_head or both (tied) as int8 rows, one symmetric scale per row (in the compute dtype): ids in,
    scaled rows out; hidden states in, logits out (`aten._weight_int8pack_mm`). `weight` is the dequantized table,
    made on first use and kept outside the state dict: drafters score rows of it, the target's forward never reads it."""

    def __init__(self, weight: torch.Tensor) -> None:  # [V, H]
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [V]
        self.qweight = nn.Parameter(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale.to(weight.dtype), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self._dense: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:  # [V, H] in the compute dtype
        if self._dense is None or self._dense.device != self.qweight.device:
            self._dense = self.qweight.to(self.scale.dtype) * self.scale[:, None]
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():  # [...] ids -> [..., H]
            return self.qweight[x].to(self.scale.dtype) * self.scale[x].unsqueeze(-1)
        if x.numel() == self.in_features and torch.compiler.is_compiling():  # one row: a reduction inductor fuses,
            y = (self.qweight.float() * x.reshape(1, -1).float()).sum(-1) * self.scale.float()  # faster than aten's
            return y.to(self.scale.dtype).reshape(*x.shape[:-1], self.out_features)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.qweight, self.scale)
        return y.reshape(*x.shape[:-1], self.out_features)


@backend("torchao_int4",
         description="torchao int4 weight-only (CPU tinygemm layout), bf16 weights+activations elsewhere",
         bits=(4,), grouped=True, group_sizes=(32, 64, 128), devices=("cpu",), library="torchao", extra="torchao",
         probe=_int4_cpu_probe)
def apply_torchao_int4(model: nn.Module, spec: QuantSpec) -> nn.Module:
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    model = model.to(torch.bfloat16)  # the CPU int4 kernel takes bf16 activations
    quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=spec.group_size), filter_fn=_only(model))
    replace_linears(model, lambda name, linear: Int4Linear(linear.weight)
                    if linear.bias is None and hasattr(linear.weight, "qdata") else linear)
    return model


@backend("torchao_int4h8",
         description="torchao int4 weight-only (CPU tinygemm layout), the embedding and lm_head in int8 rows, one "
                     "table when tied (the embedded GGUF's layout: Q4_1 body, Q8_0 table), bf16 activations",
         bits=(4,), grouped=True, group_sizes=(32, 64, 128), devices=("cpu",), library="torchao", extra="torchao",
         probe=_int4_cpu_probe)
def apply_torchao_int4h8(model: nn.Module, spec: QuantSpec) -> nn.Module:
    return int8_table(apply_torchao_int4(model, spec))


def int8_table(model: nn.Module, rows: type[Int8Rows] = Int8Rows) -> nn.Module:
    """`model` with its embedding and lm_head as `rows` (one table when tied); an EAGLE head has neither."""
    if hasattr(model, "get_input_embeddings"):
        table, head = model.get_input_embeddings(), model.get_output_embeddings()
        embed = rows(table.weight)
        model.set_input_embeddings(embed)
        model.set_output_embeddings(embed if head.weight is table.weight else rows(head.weight))  # tied: one table
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
