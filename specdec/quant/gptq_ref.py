"""GPTQ reference (`gptqref3`, `gptqref4`): the GPTQ algorithm written out in torch, numerics only.

Owns `gptq_quantize`, `layer_hessians` (H = 2/n sum x x^T per linear, one pass of the unquantized model over
`specdec.quant.texts`) and the backend `gptqref` (stored dequantized, like `rtn`), as Frantar et al.'s reference code
(damping, lazy blocks of 128 columns, no act-order). Knows nothing about drafting or kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from specdec.quant.layers import quantizable_linears
from specdec.quant.registry import QuantSpec, backend
from specdec.quant.rtn import _rtn_nominal_bits, grid, group_width, snap
from specdec.quant.texts import calibration_samples

DAMPING = 0.1
"""Fraction of the mean Hessian diagonal added to the diagonal (GPTQ's `percdamp`; the paper's code
uses 0.01). Stronger than the paper's because the calibration set is small (~1.5k tokens for layers
up to 1,536 wide); `specdec.quant.quant_report` measures agreement and KL for any setting."""
BLOCK = 128  # Columns per lazy batch (the error of a block reaches later blocks in one matrix product).


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int | None,
                  symmetric: bool, damping: float = DAMPING, block: int = BLOCK) -> torch.Tensor:
    """GPTQ-quantize `weight` [O, I] given the Hessian [I, I] of its layer's inputs; returns the
    dequantized weight in weight's dtype. One column at a time: round it, spread its error
    e_i = (w_i - q_i) / U[i, i] over later columns by w_j -= e_i U[i, j] (U: upper Cholesky of H^-1);
    group scales are fitted at a group's first column. float64 for float64 weights, else float32."""
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"gptq_quantize needs weight [O, I] and hessian [I, I], got {tuple(weight.shape)} "
                         f"and {tuple(hessian.shape)}")
    out_features, in_features = weight.shape
    group = group_width(in_features, group_size)
    compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(compute).clone()  # [O, I]
    h = hessian.detach().to(compute).clone()  # [I, I]
    dead = torch.diag(h) == 0  # inputs never active: any weight works, make it exactly zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damping * torch.diag(h).mean() * torch.eye(in_features, dtype=compute)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [I, I]
    # A lazy block must hold whole groups so a group's scale sees its error-updated columns.
    block = max(group, block // group * group) if group < in_features else in_features
    q = torch.zeros_like(w)
    scale = offset = None
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        w1 = w[:, start:end].clone()  # [O, b] updated as columns to its left are rounded
        err = torch.zeros_like(w1)
        u1 = u[start:end, start:end]
        for i in range(end - start):
            if (start + i) % group == 0:
                scale, offset = grid(w1[:, i:i + group], bits, symmetric)
            col = w1[:, i:i + 1]  # [O, 1]
            q[:, start + i:start + i + 1] = snap(col, scale, offset, bits, symmetric)
            e = (col - q[:, start + i:start + i + 1]) / u1[i, i]
            w1[:, i:] -= e @ u1[i:i + 1, i:]
            err[:, i:i + 1] = e
        w[:, end:] -= err @ u[start:end, end:]
    return q.to(weight.dtype)


@torch.no_grad()
def layer_hessians(model: nn.Module, samples: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """H = 2/n sum_t x_t x_t^T [I, I] per quantizable linear, x_t its input at each of the n tokens
    of `samples` (token id sequences, each run as one causal forward of the unquantized model)."""
    if not samples or not all(len(s) for s in samples):
        raise ValueError("layer_hessians needs at least one non-empty calibration sequence")
    device = next(model.parameters()).device
    sums: dict[str, torch.Tensor] = {}
    count = 0

    def hook(name):
        def add(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float64)  # [tokens, I]
            sums[name] = sums.get(name, 0) + x.T @ x
        return add

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in quantizable_linears(model)]
    try:
        for ids in samples:
            model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
            count += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    return {name: 2 * s / count for name, s in sums.items()}


def gptq_quantize_model(model: nn.Module, spec: QuantSpec, samples: Sequence[Sequence[int]]) -> nn.Module:
    """Quantize every quantizable linear of `model` in place by GPTQ, Hessians from `samples`."""
    hessians = layer_hessians(model, samples)
    with torch.no_grad():
        for name in quantizable_linears(model):
            linear = model.get_submodule(name)
            h = hessians[name].to(linear.weight.device)
            linear.weight.copy_(gptq_quantize(linear.weight, h, spec.bits, spec.group_size, spec.symmetric))
    return model


@backend("gptqref", description="GPTQ reference (hand-written, calibrated on specdec-calibration-v1), stored "
         "dequantized (numerics only, fp speed)", bits=(3, 4), bits_in_name=True, grouped=True, per_channel=True,
         symmetric_option=True, default_group_size=64, packed=False, nominal_bits=_rtn_nominal_bits,
         calibrated=True)
def apply_gptqref(model: nn.Module, spec: QuantSpec, tokenizer: Any) -> nn.Module:
    return gptq_quantize_model(model, spec, _calibration(model, tokenizer))


def _calibration(model: nn.Module, tokenizer: Any) -> list[list[int]]:
    """The calibration texts' token ids; for a model without a tokenizer (the tiny test models, which
    have no text), 8 fixed pseudo-random sequences of 64 ids, as the quantization report does."""
    if tokenizer is not None:
        return calibration_samples(tokenizer)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (8, 64), generator=generator).tolist()
