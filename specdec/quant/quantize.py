"""Quantizing a Target: `quantize_target` (in place; the spec and a weight report in `info["quant"]`) and
`quantized_copy` (a deep copy). Every check runs before the model is touched (`check_quantizable`), every layer is
checked after; never another backend. A kernel-packed target is unpacked first and repacked with its kernel.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from specdec.runtime import kernels
from specdec.runtime.model import Target
from specdec.quant.layers import check_group_size, quantizable_linears, weight_bytes
from specdec.quant.registry import BackendUnavailableError, QuantSpec, QuantSpecError, availability, get, parse_spec
from specdec.quant.texts import calibration_description


def check_quantizable(target: Target, spec: str | QuantSpec) -> QuantSpec:
    """Every check `quantize_target` makes before touching the model; returns the parsed spec.
    Raises `QuantSpecError` for what the backend does not support (or an already quantized target)
    and `BackendUnavailableError` (naming the pip extra) when it cannot run here."""
    spec = parse_spec(spec)
    b = get(spec.backend)
    previous = target.quant
    if get(parse_spec(previous).backend).packed:
        raise QuantSpecError(f"{target.name!r} is already quantized ({previous}); quantize the unquantized model "
                             f"instead (e.g. quantized_copy of the original target). Only targets whose weights "
                             f"are stored dequantized (rtn) can be quantized again")
    if b.dtypes is not None and target.dtype not in b.dtypes:
        raise QuantSpecError(f"{spec.text}: backend {b.name!r} quantizes models in {[str(d) for d in b.dtypes]}, "
                             f"but {target.name!r} is {target.dtype}; load it in one of those dtypes")
    with kernels.plain_linears(target.model) as model:
        check_group_size(model, spec)
    available = availability(spec, target.device)
    if not available.ok:
        raise BackendUnavailableError(f"cannot quantize {target.name!r} with {spec.text!r}: {available.reason}")
    return spec


def _layer_signature(module: torch.nn.Module) -> tuple:
    """What a quantizing backend must change about a linear: its class, its weight's class or dtype."""
    weight = getattr(module, "weight", None)
    return type(module), type(weight), getattr(weight, "dtype", None)


def quantize_target(target: Target, spec: str | QuantSpec) -> Target:
    """Quantize `target` in place by `spec` and return it (`quantized_copy` for a copy); raises what
    `check_quantizable` raises, and RuntimeError if a layer it was given stayed unquantized."""
    spec = check_quantizable(target, spec)
    b = get(spec.backend)
    model = target.model
    kernels.apply_kernel(model, "torch")  # backends know nn.Linear only
    layers = [] if b.name == "none" else quantizable_linears(model)
    params = sum(p.numel() for p in model.parameters())  # before packing changes numel
    quantized_params = sum(model.get_submodule(n).weight.numel() for n in layers)
    bytes_before = weight_bytes(model)
    before = {n: _layer_signature(model.get_submodule(n)) for n in layers}
    model = b.apply(model, spec, target.tokenizer) if b.calibrated else b.apply(model, spec)
    if b.packed:
        skipped = [n for n in layers if _layer_signature(model.get_submodule(n)) == before[n]]
        if skipped:
            raise RuntimeError(f"{spec.text}: backend {b.name!r} left {len(skipped)} of {len(layers)} layers "
                               f"unquantized ({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''})")
    layer_bytes = sum(weight_bytes(model.get_submodule(n)) for n in layers)
    info: dict[str, Any] = {
        "spec": spec.text,
        "backend": b.name,
        "description": b.description,
        "bits": spec.bits,
        "group_size": spec.group_size,
        "symmetric": spec.symmetric,
        "packed": b.packed,
        "layers_quantized": len(layers),
        "params": params,
        "quantized_params": quantized_params,
        "weight_bytes_before": bytes_before,
        "weight_bytes": weight_bytes(model),
        "bits_per_param": 8 * weight_bytes(model) / params,
        "bits_per_quantized_weight": 8 * layer_bytes / quantized_params if quantized_params else None,
        "nominal_bits_per_quantized_weight": b.nominal_bits(spec) if b.nominal_bits else None,
        "calibration": calibration_description() if b.calibrated else None,
        "on_top_of": None if target.quant == "none" else target.quant,
    }
    quantized = Target(model, target.tokenizer, name=target.name, quant=spec.text, info={**target.info, "quant": info})
    return kernels.use_kernel(quantized, target.info.get("kernel", {}).get("requested", target.kernel))


def quantized_copy(target: Target, spec: str | QuantSpec) -> Target:
    """A quantized deep copy of `target`; `target` itself is not modified. Checks the spec before
    copying, so a bad spec fails fast."""
    check_quantizable(target, spec)
    with kernels.plain_linears(target.model) as plain:  # deep-copy plain linears, not packed weights
        model = copy.deepcopy(plain)
    clone = Target(model, target.tokenizer, name=target.name, quant=target.quant, info=dict(target.info))
    return quantize_target(clone, spec)
