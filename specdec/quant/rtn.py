"""The project's own round-to-nearest (RTN) fake quantization, and the dtype casts.

Owns `rtn_quantize` and the backends `rtn` (2..8 bits, group or per-channel, symmetric or not), `none`, `bf16`, `fp16`.
RTN weights are stored dequantized: numerics (acceptance) without speed. Needs only torch.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.quant.layers import quantizable_linears
from specdec.quant.registry import QuantSpec, backend


def group_width(in_features: int, group_size: int | None) -> int:
    """The group width along a row (None: the whole row); ValueError when it does not divide the row."""
    group = in_features if group_size is None else group_size
    if group < 1 or in_features % group:
        raise ValueError(f"group size {group_size} does not divide the input width {in_features}")
    return group


def grid(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) [..., 1] of each group `w` [..., g] on RTN's grid (see `rtn_quantize`)."""
    if symmetric:
        scale = w.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
        offset = torch.zeros_like(scale)
    else:
        offset = w.amin(-1, keepdim=True)
        scale = (w.amax(-1, keepdim=True) - offset) / (2**bits - 1)
    return torch.where(scale > 0, scale, torch.ones_like(scale)), offset


def snap(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """`w` rounded onto the grid (`grid`) and dequantized."""
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    return offset + torch.clamp(torch.round((w - offset) / scale), lo, hi) * scale


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool) -> torch.Tensor:
    """Round-to-nearest quantize `weight` [O, I] group-wise along I (`group_size` None: per row) and
    return it dequantized in weight's dtype. Asymmetric: s = (max - min) / (2^b - 1), w' = min + s
    round((w - min) / s) (min a float offset, as GGUF Q4_1); symmetric: s = max|w| / (2^(b-1) - 1),
    w' = s round(w / s). Computed in float32 (float64 for float64 weights)."""
    if weight.dim() != 2:
        raise ValueError(f"rtn_quantize expects a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"rtn_quantize supports 2..8 bits, got {bits}")
    out_features, in_features = weight.shape
    group = group_width(in_features, group_size)
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(compute).reshape(out_features, in_features // group, group)  # [O, G, g]
    deq = snap(w, *grid(w, bits, symmetric), bits, symmetric)
    return deq.reshape(out_features, in_features).to(weight.dtype)


def _rtn_nominal_bits(spec: QuantSpec) -> float:
    """Bits per weight if packed: b bits plus an fp16 scale (and an fp16 min when asymmetric) per group."""
    if spec.group_size is None:
        return float(spec.bits)  # per-row metadata is negligible next to a row of weights
    return spec.bits + (16 if spec.symmetric else 32) / spec.group_size


@backend("rtn", description="round-to-nearest, group-wise, stored dequantized (numerics only, fp speed)",
         bits=tuple(range(2, 9)), bits_in_name=True, grouped=True, per_channel=True, symmetric_option=True,
         packed=False, nominal_bits=_rtn_nominal_bits, default_group_size=64)
def apply_rtn(model: nn.Module, spec: QuantSpec) -> nn.Module:
    with torch.no_grad():
        for name in quantizable_linears(model):
            linear = model.get_submodule(name)
            linear.weight.copy_(rtn_quantize(linear.weight, spec.bits, spec.group_size, spec.symmetric))
    return model


@backend("none", description="unquantized (as loaded)", packed=False)
def apply_none(model: nn.Module, spec: QuantSpec) -> nn.Module:
    return model


@backend("bf16", description="whole model cast to bfloat16 (weights and activations)", bits=(16,))
def apply_bf16(model: nn.Module, spec: QuantSpec) -> nn.Module:
    return model.to(torch.bfloat16)


@backend("fp16", description="whole model cast to float16 (weights and activations)", bits=(16,))
def apply_fp16(model: nn.Module, spec: QuantSpec) -> nn.Module:
    return model.to(torch.float16)
