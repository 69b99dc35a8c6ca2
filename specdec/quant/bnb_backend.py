"""bitsandbytes adapters: `bnb_int8` (LLM.int8) and `bnb_nf4` / `bnb_fp4`: the swap to `Linear8bitLt` / `Linear4bit` and
`bnb_linear_kwargs` (a group along each row, default 32). On a CPU it dequantizes per forward: numerics, not speed.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specdec.quant.layers import quantizable_linears, replace_linears
from specdec.quant.registry import QuantSpec, QuantSpecError, backend

INT8_OUTLIER_THRESHOLD = 6.0
"""LLM.int8 outlier threshold (activation magnitude above which a column runs in fp16), as in HF."""


class _DropCastNotice(logging.Filter):
    """Drops bitsandbytes' per-call 'inputs will be cast ... to float16' notice (stated once in the
    backend description instead of once per linear per forward)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will be cast from" not in record.getMessage()


def bnb_linear_kwargs(spec: QuantSpec, linear: nn.Linear) -> dict:
    """Constructor arguments of the bitsandbytes module replacing `linear` under `spec`."""
    common = {"input_features": linear.in_features, "output_features": linear.out_features,
              "bias": linear.bias is not None}
    if spec.backend == "bnb_int8":
        return {**common, "has_fp16_weights": False, "threshold": INT8_OUTLIER_THRESHOLD}
    quant_type = {"bnb_nf4": "nf4", "bnb_fp4": "fp4"}[spec.backend]
    return {**common, "compute_dtype": linear.weight.dtype, "quant_type": quant_type, "compress_statistics": False}


CPU_4BIT_BLOCK_N = 32
"""bitsandbytes repacks 4-bit weights for its CPU kernel on CPUs with AVX512-BF16, in blocks of 32 output rows."""


def check_cpu_4bit_rows(model: nn.Module, spec: QuantSpec, repacks: bool) -> None:
    """Raise `QuantSpecError` if bitsandbytes' CPU 4-bit repacking (`repacks`) cannot take a layer:
    its output width must be a multiple of 32 (the library would fail with a bare assert mid-forward)."""
    if not repacks or spec.backend == "bnb_int8":
        return
    bad = [f"{name} ({model.get_submodule(name).out_features})" for name in quantizable_linears(model)
           if model.get_submodule(name).out_features % CPU_4BIT_BLOCK_N]
    if bad:
        raise QuantSpecError(
            f"{spec.text}: on this CPU (AVX512-BF16) bitsandbytes repacks 4-bit weights in blocks of "
            f"{CPU_4BIT_BLOCK_N} output rows, and these layers' output widths are not multiples of "
            f"{CPU_4BIT_BLOCK_N}: {', '.join(bad)}; use another backend (e.g. hqq4, rtn4) for this model"
        )


def _swap(model: nn.Module, spec: QuantSpec) -> nn.Module:
    import bitsandbytes as bnb
    from bitsandbytes.functional import has_avx512bf16

    on_cpu = model.get_output_embeddings().weight.device.type == "cpu"
    check_cpu_4bit_rows(model, spec, repacks=on_cpu and has_avx512bf16())

    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropCastNotice())

    def make(name: str, linear: nn.Linear) -> nn.Module:
        kwargs = bnb_linear_kwargs(spec, linear)
        weight = linear.weight.data.detach().clone()
        if spec.backend == "bnb_int8":
            new = bnb.nn.Linear8bitLt(**kwargs, device="meta")
            new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(**kwargs, device="meta")
            new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=kwargs["quant_type"],
                                           blocksize=spec.group_size, compress_statistics=False, module=new)
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.data.detach().clone(), requires_grad=False)
        return new.to(linear.weight.device)  # moving a bnb param to its device quantizes it

    replace_linears(model, make)
    return model


_BNB = {"library": "bitsandbytes", "extra": "bnb", "dtypes": (torch.float16, torch.bfloat16, torch.float32)}


# One swap serves all three formats: `_swap` reads the format from the spec's name.
backend("bnb_int8", description="bitsandbytes LLM.int8 (int8 per-row weights, fp16 outlier columns)",
        bits=(8,), **_BNB)(_swap)
backend("bnb_nf4", description="bitsandbytes 4-bit NormalFloat, absmax per block, model-dtype compute",
        bits=(4,), grouped=True, group_sizes=(32, 64, 128, 256), **_BNB)(_swap)
backend("bnb_fp4", description="bitsandbytes 4-bit float (e2m1), absmax per block, model-dtype compute",
        bits=(4,), grouped=True, group_sizes=(32, 64, 128, 256), **_BNB)(_swap)
