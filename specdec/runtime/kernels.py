"""Which kernel runs a model's plain linear layers: a registry, and a choice measured per machine.

Owns the linear-kernel registry (`torch`, `onednn`, `hybrid`: see docs/library.md), the module swap and its inverse
(`apply_kernel`, `plain_linears`), `measure_choice` (run by `python -m specdec.tune`) and `use_kernel`: `auto` looks
the choice up in the machine's tune record, else `specdec.machine.DEFAULT_KERNEL`; it never measures. A kernel
changes rounding in the last bits, never the weights; it touches only exact `nn.Linear`s it can pack (`why_not`).
Knows nothing about drafting, caches or quantization formats.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from specdec.runtime.cache import KVCache
from specdec import machine
from specdec.runtime.model import Target



class OneDNNLinear(nn.Module):
    """`nn.Linear`'s forward over a weight prepacked for oneDNN.

    `weight` and `bias` are the original Parameters (shared, not copied); `packed` is derived from
    `weight` at construction (and again after `.to()` / a dtype cast) and is not a parameter: after
    changing `weight` in place, build a new module. With `plain_one_row` (the `hybrid` kernel) a one-row
    product runs `F.linear` on `weight` instead.
    """

    def __init__(self, linear: nn.Linear, plain_one_row: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias  # [out] or None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.plain_one_row = plain_one_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.plain_one_row and x.numel() == self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _apply(self, fn, recurse: bool = True):
        """`.to(...)`, `.bfloat16()`, ...: the Parameters change, so pack them again; ValueError where
        oneDNN cannot run them (another device, a dtype it does not pack)."""
        super()._apply(fn, recurse)
        reason = why_not("onednn", self.weight.device, self.weight.dtype)
        if reason:
            raise ValueError(f"a linear packed for oneDNN cannot become {self.weight.dtype} on {self.weight.device} "
                             f"({reason}); unpack first: specdec.runtime.kernels.apply_kernel(model, 'torch')")
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        return self

    def __deepcopy__(self, memo: dict) -> OneDNNLinear:
        """A copy over deep-copied Parameters (ties kept through `memo`), packed again: oneDNN's
        packed tensor has no storage to copy."""
        return OneDNNLinear(copy.deepcopy(self.plain(), memo), self.plain_one_row)

    def plain(self) -> nn.Linear:
        """An `nn.Linear` over the same Parameters (no copy)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"plain_one_row={self.plain_one_row}")


def _onednn_probe(dtype: torch.dtype) -> str | None:
    """Per dtype: oneDNN packs bf16 weights only on CPUs with bf16 conversion instructions (AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT); an AVX2-only CPU packs float32 and refuses bf16."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    try:
        OneDNNLinear(nn.Linear(8, 8, dtype=dtype))(torch.ones(2, 8, dtype=dtype))
    except (RuntimeError, AttributeError) as err:
        name = str(dtype).removeprefix("torch.")
        return f"oneDNN's prepacked {name} linear failed here: {err.__class__.__name__}: {str(err).splitlines()[0]}"
    return None


@dataclass(frozen=True)
class LinearKernel:
    """A registered way of running plain linear layers."""

    name: str
    description: str
    """One line for reports."""
    pack: Callable[[nn.Linear], nn.Module] | None
    """Build the replacement of one linear; None = leave the `nn.Linear` as it is."""
    devices: tuple[str, ...]
    """Device types it runs on."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """Weight dtypes it packs (None = any)."""
    probe: Callable[[torch.dtype], str | None] | None = None
    """A check run once per weight dtype: why it cannot run that dtype in this torch build on this CPU, or None."""
    plain_one_row: bool = False
    """For a kernel that packs into `OneDNNLinear`: run one-row products with `F.linear` instead."""


KERNELS: dict[str, LinearKernel] = {
    "torch": LinearKernel("torch", "the modules as loaded (F.linear: MKL / oneDNN / cuBLAS as torch picks)",
                          pack=None, devices=("cpu", "cuda")),
    "onednn": LinearKernel("onednn", "weights prepacked once for oneDNN (torch.ops.mkldnn._linear_pointwise)",
                           pack=OneDNNLinear, devices=("cpu",), dtypes=(torch.float32, torch.bfloat16),
                           probe=_onednn_probe),
    "hybrid": LinearKernel("hybrid", "onednn, but one-row products by F.linear on the weight as loaded",
                           pack=functools.partial(OneDNNLinear, plain_one_row=True), devices=("cpu",),
                           dtypes=(torch.float32, torch.bfloat16), probe=_onednn_probe, plain_one_row=True),
}
CHOICES = ("auto", *KERNELS)
_PROBED: dict[tuple[str, torch.dtype], str | None] = {}


def why_not(kernel: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why `kernel` cannot run linears of `dtype` on `device` here, or None when it can."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {', '.join(CHOICES)}")
    k = KERNELS[kernel]
    device_type = torch.device(device).type
    if device_type not in k.devices:
        return f"kernel {kernel!r} runs on {' or '.join(k.devices)} only, not on {device_type}"
    if k.dtypes is not None and dtype not in k.dtypes:
        return f"kernel {kernel!r} runs {[str(d).replace('torch.', '') for d in k.dtypes]} weights, not {dtype}"
    if k.probe is not None:
        if (kernel, dtype) not in _PROBED:
            _PROBED[kernel, dtype] = k.probe(dtype)
        return _PROBED[kernel, dtype]
    return None


def _packable(module: nn.Module, kernel: LinearKernel) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and type(weight) is nn.Parameter and weight.layout == torch.strided
            and why_not(kernel.name, weight.device, weight.dtype) is None)


def _swap(model: nn.Module, make: Callable[[nn.Module], nn.Module | None]) -> int:
    """Replace each submodule m (and `model` itself never) by make(m) where that is not None."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = make(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count


def apply_kernel(model: nn.Module, kernel: str) -> int:
    """Run `model`'s plain linears (fp32/bf16 `nn.Linear` of a dtype `kernel` packs here: `why_not`) with `kernel`, in
    place; returns how many were swapped. `torch` first restores plain linears; `onednn` <-> `hybrid` only switches how
    the packed linears run one-row products. Raises ValueError for an unknown kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    k = KERNELS[kernel]
    if k.pack is None:
        return _swap(model, lambda m: m.plain() if isinstance(m, OneDNNLinear) else None)
    for module in model.modules():
        if isinstance(module, OneDNNLinear):
            module.plain_one_row = k.plain_one_row
    return _swap(model, lambda m: k.pack(m) if _packable(m, k) else None)


@contextmanager
def plain_linears(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model`'s packed linears are plain `nn.Linear`s over the same Parameters (for
    a deep copy or a quantizer, which know only nn.Linear); the packed modules are put back after."""
    packed: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, OneDNNLinear):
                packed.append((parent, name, child))
                setattr(parent, name, child.plain())
    try:
        yield model
    finally:
        for parent, name, child in packed:
            setattr(parent, name, child)


def linear_over(weight: torch.Tensor, kernel: str) -> nn.Module | None:
    """x [..., H] -> x @ weight^T [..., N] run by `kernel` over `weight` [N, H] (shared, not copied),
    for a drafter's rows of an lm_head; None when `kernel` leaves linears as loaded (`torch`) or cannot
    pack `weight`'s dtype, so the caller keeps its own product."""
    k = KERNELS[kernel]
    if k.pack is None or why_not(kernel, weight.device, weight.dtype) is not None:
        return None
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return k.pack(linear)


def kernel_in_use(model: nn.Module) -> str:
    """`hybrid` or `onednn` if any linear of `model` is packed for oneDNN (by how it runs one row),
    else `torch`."""
    packed = [m for m in model.modules() if isinstance(m, OneDNNLinear)]
    if not packed:
        return "torch"
    return "hybrid" if packed[0].plain_one_row else "onednn"


# ---- the measured choice -----------------------------------------------------------------------
CHOICE_WIDTHS = (1, 8)
"""Widths `auto` times: one plain decoding step and a typical verification (a chain(7) or small tree)."""


def candidates(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Kernels that can run `dtype` linears on `device` here, `torch` first."""
    return [name for name in KERNELS if why_not(name, device, dtype) is None]


def resolve(kernel: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Check an explicit kernel (ValueError naming it and why it cannot run); `auto` -> None when more
    than one kernel can run here (so it must be measured), else the only one."""
    if kernel not in CHOICES:
        raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {', '.join(CHOICES)}")
    if kernel != "auto":
        reason = why_not(kernel, device, dtype)
        if reason:
            raise ValueError(f"kernel={kernel!r} cannot run here: {reason}; use kernel='auto' or 'torch'")
        return kernel
    names = candidates(device, dtype)
    return names[0] if len(names) == 1 else None


def pick(seconds: dict[str, dict[int, float]]) -> str:
    """The kernel with the least total time over the measured widths (ties: the first listed)."""
    return min(seconds, key=lambda name: sum(seconds[name].values()))


def measure_choice(target: Target, names: list[str], repeats: int = 5, context: int = 64) -> dict:
    """Time `target`'s forward at `CHOICE_WIDTHS` after `context` cached tokens under each kernel of
    `names` (the packing kernels share one packed copy), interleaved per repeat after a warm-up round,
    median kept; leaves the model on the fastest. Returns the `kernel` field of a tune record."""
    packing = [name for name in names if KERNELS[name].pack is not None]
    if packing:
        apply_kernel(target.model, packing[0])
    context = max(1, min(context, target.context_length - max(CHOICE_WIDTHS)))
    gen = torch.Generator().manual_seed(0)
    cache = KVCache()
    target.prefill(torch.randint(0, target.vocab_size, (context,), generator=gen).tolist(), cache)
    times: dict[str, dict[int, list[float]]] = {name: {w: [] for w in CHOICE_WIDTHS} for name in names}
    for rep in range(repeats + 1):
        for name in names:
            if name in packing:
                apply_kernel(target.model, name)  # the packed linears' one-row mode
            with (plain_linears if KERNELS[name].pack is None else nullcontext)(target.model):
                view = dataclasses.replace(target, kernel=name)  # its lm_head as the model now holds it
                for w in CHOICE_WIDTHS:
                    tokens = torch.randint(0, target.vocab_size, (1, w), generator=gen)
                    t0 = time.perf_counter()
                    view.forward(tokens, cache, torch.full((w,), -1, dtype=torch.long))
                    if rep:  # rep 0 warms up
                        times[name][w].append(time.perf_counter() - t0)
                    cache.truncate(context)
    seconds = {name: {w: statistics.median(ts) for w, ts in per.items()} for name, per in times.items()}
    best = pick(seconds)
    apply_kernel(target.model, best)
    return {"kernel": best, "seconds": {n: {str(w): s for w, s in t.items()} for n, t in seconds.items()},
            "widths": list(CHOICE_WIDTHS), "context": context, "repeats": repeats,
            "machine": machine.machine_name(target.device), "threads": torch.get_num_threads(), "torch": torch.__version__}


def use_kernel(target: Target, kernel: str = "auto") -> Target:
    """`target` with its plain linears run by `kernel` (in place: the returned Target wraps the same model; do not use
    the given one afterwards). `auto` takes the only kernel that can run here, else the one `python -m specdec.tune`
    stored, else `specdec.machine.DEFAULT_KERNEL` (not tuned); it measures nothing. A kernel that cannot run here,
    explicit or stored, is a ValueError naming why. The choice and its source go to `info["kernel"]`."""
    chosen = resolve(kernel, target.device, target.dtype)
    record: dict = {"requested": kernel}
    if chosen is None:
        tuned = (machine.load_record(target.label, target.device, target.dtype) or {}).get("kernel")
        if tuned is None:
            chosen = machine.DEFAULT_KERNEL
            record.update(tuned=False, note=f"not tuned: `python -m specdec.tune {target.name}` measures the choice")
        else:
            chosen = tuned.get("kernel")
            reason = why_not(chosen, target.device, target.dtype) if chosen in KERNELS else "unknown kernel"
            if reason:
                path = machine.record_path(target.label, target.device, target.dtype)
                raise machine.TuneError(f"tune record {path} names kernel {chosen!r}, which cannot run here "
                                        f"({reason}); run `python -m specdec.tune {target.name}` again")
            record.update(tuned=True, seconds=tuned.get("seconds"), threads=tuned.get("threads"))
    apply_kernel(target.model, chosen)
    record.update(kernel=chosen, description=KERNELS[chosen].description)
    return dataclasses.replace(target, kernel=chosen, info={**target.info, "kernel": record})
