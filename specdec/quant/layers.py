"""Which layers get quantized, and the module-swap helpers backends share.

Owns the one rule (every `nn.Linear` but `lm_head`), the group-size check (a group must divide every quantized
layer's input width) and weight-byte accounting over packed formats. Knows nothing about any algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from specdec.quant.registry import QuantSpec, QuantSpecError, get


def quantizable_linears(model: nn.Module) -> list[str]:
    """Qualified names of the `nn.Linear` modules a backend quantizes (all but the lm_head); ValueError for linears
    packed for a kernel (they would be skipped silently: `quantize_target` unpacks them first)."""
    from specdec.runtime.kernels import OneDNNLinear

    packed = [name for name, module in model.named_modules() if isinstance(module, OneDNNLinear)]
    if packed:
        raise ValueError(f"{len(packed)} linears of this model ({packed[0]}, ...) are packed for the onednn kernel; "
                         "quantize through specdec.quant.quantize_target / quantized_copy, or unpack first with "
                         "specdec.runtime.kernels.apply_kernel(model, 'torch')")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and module is not head]


def check_group_size(model: nn.Module, spec: QuantSpec) -> None:
    """Raise `QuantSpecError` if `spec.group_size` does not divide a quantized layer's input width."""
    if spec.group_size is None:
        return
    bad = {}
    for name in quantizable_linears(model):
        width = model.get_submodule(name).in_features
        if width % spec.group_size:
            bad.setdefault(width, name)
    if bad:
        widths = sorted(bad)
        fits = [g for g in (32, 64, 128, 256) if all(w % g == 0 for w in _all_widths(model))]
        raise QuantSpecError(
            f"{spec.text}: group size {spec.group_size} does not divide the input width of "
            f"{', '.join(f'{bad[w]} ({w})' for w in widths)}; group sizes that divide every quantized layer "
            f"of this model: {fits or 'none of 32/64/128/256'}"
            + (", or per-channel '_pc'" if get(spec.backend).per_channel else "")
        )


def _all_widths(model: nn.Module) -> set[int]:
    return {model.get_submodule(name).in_features for name in quantizable_linears(model)}


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> int:
    """Replace every quantizable linear `name` by `make(name, linear)`; return how many."""
    names = quantizable_linears(model)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(name, getattr(parent, attr)))
    return len(names)


def _leaf_tensors(value) -> Iterator[torch.Tensor]:
    """Plain tensors inside `value`: unpacks tuples/lists/dicts, torch quantized tensors and tensor
    subclasses that implement `__tensor_flatten__` (torchao's packed formats)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaf_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaf_tensors(item)
    elif isinstance(value, torch.Tensor):
        if value.is_quantized:
            yield value.int_repr()
            if value.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
                yield value.q_per_channel_scales()
                yield value.q_per_channel_zero_points()
        elif type(value) not in (torch.Tensor, nn.Parameter) and hasattr(value, "__tensor_flatten__"):
            inner, _ = value.__tensor_flatten__()
            for name in inner:
                yield from _leaf_tensors(getattr(value, name))
        else:
            yield value


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor in the model's state dict (packed formats counted by their real storage;
    tensors shared between entries, such as tied embeddings, counted once)."""
    seen: set[tuple[int, int, torch.dtype]] = set()
    total = 0
    for value in model.state_dict(keep_vars=True).values():
        for t in _leaf_tensors(value):
            if t.device.type == "meta":
                continue
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key in seen:
                continue
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
