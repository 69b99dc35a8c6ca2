"""HQQ adapter (`hqq1` .. `hqq8`): the swap to `HQQLinear` and `hqq_config` (groups along rows, multiples of 8), on
HQQ's PyTorch backend (dequantize per forward): on a CPU a numerics backend, not a speed one.
"""

from __future__ import annotations

from torch import nn

from specdec.quant.layers import replace_linears
from specdec.quant.registry import QuantSpec, backend

HQQ_BITS = (1, 2, 3, 4, 8)


def hqq_config(spec: QuantSpec) -> dict:
    """Keyword arguments of `hqq.core.quantize.BaseQuantizeConfig` for `spec`."""
    if spec.group_size is not None and spec.group_size % 8:
        raise ValueError(f"{spec.text}: HQQ group sizes must be multiples of 8, got {spec.group_size}")
    return {"nbits": spec.bits, "group_size": spec.group_size, "axis": 1}


@backend("hqq", description="HQQ (half-quadratic, calibration-free) group-wise, PyTorch dequantize backend",
         bits=HQQ_BITS, bits_in_name=True, grouped=True, group_sizes=(8, 16, 32, 64, 128, 256),
         library="hqq", extra="hqq")
def apply_hqq(model: nn.Module, spec: QuantSpec) -> nn.Module:
    from hqq.core.quantize import BaseQuantizeConfig, HQQBackend, HQQLinear

    HQQLinear.set_backend(HQQBackend.PYTORCH)
    config = BaseQuantizeConfig(**hqq_config(spec))

    def make(name: str, linear: nn.Linear) -> nn.Module:
        return HQQLinear(linear, config, compute_dtype=linear.weight.dtype, device=str(linear.weight.device),
                         del_orig=False)

    replace_linears(model, make)
    return model
