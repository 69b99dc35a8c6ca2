"""`native_int4h8`: torchao_int4h8's weights (the same int4 g32 values, scales and zeros, the same int8 table) run by
specdec's own CPU kernels, `csrc/lowbit.cpp`, which this module builds with the machine's C++ compiler on first use.

Owns the build (`load`: compiled once per source, torch and CPU, kept under `$SPECDEC_CACHE/native`, announced on
stderr), the kernels' shapes and a merge pass for `torch.compile`, and the plain modules `NativeInt4Linear`,
`NativePart` and `NativeInt8Rows`. Knows which layers to touch only through `quantizable_linears` and the names of
sibling linears (`SIBLINGS`). Hand-written because aten's CPU kernels for these layouts are compute-bound at one row
(docs/library.md); on a CPU without AVX-512 BF16 the file compiles portable loops, which tune times as they are.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch import nn

from specdec import machine
from specdec.quant.layers import replace_linears
from specdec.quant.registry import QuantSpec, backend
from specdec.quant.torch_backends import Int8Rows, int8_table

SOURCE = Path(__file__).with_name("csrc") / "lowbit.cpp"
GROUP = 32


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _probe() -> str | None:
    if _compiler() is None:
        return "no C++ compiler on PATH (set $CXX): native_int4h8 builds its kernels on first use"
    from torch.utils import cpp_extension

    if not (Path(cpp_extension.include_paths()[0]) / "torch" / "library.h").exists():
        return "this torch install has no C++ headers"
    return None


@functools.cache
def load() -> None:
    """Build (once per source, torch version and CPU) and load the `specdec_lowbit` operators."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    digest = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {flags}".encode()).hexdigest()[:16]
    target = machine.cache_root() / "native" / machine.machine_key("cpu") / f"lowbit-{digest}.so"
    if not target.exists():
        print(f"specdec: building specdec's int4/int8 CPU kernels ({SOURCE.name}, once; kept in {target.parent})",
              file=sys.stderr, flush=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        libs = cpp_extension.library_paths()[0]
        command = [_compiler(), *flags, *(f"-I{p}" for p in cpp_extension.include_paths()),
                   f"-I{sysconfig.get_paths()['include']}", str(SOURCE), f"-L{libs}", "-ltorch", "-ltorch_cpu",
                   "-lc10", f"-Wl,-rpath,{libs}", "-o", partial]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            os.unlink(partial)
            raise RuntimeError(f"building {SOURCE} failed:\n{' '.join(command)}\n{done.stderr[-4000:]}")
        os.replace(partial, target)  # atomic: processes building at once each load a whole file
    torch.ops.load_library(str(target))
    for name in ("int4_mm", "int8_mm"):  # shapes for torch.compile: [M, K] x [N, ...] -> [M, N], x's dtype
        torch.library.register_fake(f"specdec_lowbit::{name}", lambda x, q, s: x.new_empty(x.shape[0], q.shape[0]))
    from torch._inductor import config

    if config.post_grad_custom_post_pass is None:
        config.post_grad_custom_post_pass = _merge_same_products()


def _merge_same_products():
    """An inductor pass: `int4_mm` calls on the same inputs (or equal views of one tensor) become one; inductor
    merges no calls of an op it does not generate, and `NativePart`s of a stacked linear each call it on their
    parent's input. (Defined here: inductor's modules take a second to import, which `import specdec` never pays.)"""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class MergeSameProducts(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            views = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}

            def source(x):  # an input as the chain of views it is of a node: equal chains, equal tensors
                if isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target in views:
                    return (source(x.args[0]), *(tuple(a) if isinstance(a, (list, tuple)) else a for a in x.args[1:]))
                return x

            first: dict[tuple, torch.fx.Node] = {}
            for node in list(graph.nodes):  # only the products are touched; inductor drops the views left unused
                if node.op == "call_function" and node.target is torch.ops.specdec_lowbit.int4_mm.default:
                    key = tuple(source(a) for a in node.args)
                    if key in first:
                        node.replace_all_uses_with(first[key])
                        graph.erase_node(node)
                    else:
                        first[key] = node

        def uuid(self) -> str:  # inductor's caches key compiled graphs on it: this pass's own code
            return hashlib.sha256(inspect.getsource(_merge_same_products).encode()).hexdigest()

    return MergeSameProducts()


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight as (nibbles [N, K / 2] uint8, [N, 2, K / 32] float32 scale and c = zero - 136 scale): torchao's
    int4 values, scales and zeros (`torchao_int4`'s tinygemm rule, w = (q - 8) scale + zero), in the kernel's layout."""
    from torchao.quantization.quant_primitives import (
        MappingType, _choose_qparams_affine_tinygemm, _quantize_affine_tinygemm,
    )

    n, k = weight.shape
    scale, zero = _choose_qparams_affine_tinygemm(weight, MappingType.ASYMMETRIC, [1, GROUP], torch.int32, 0, 15, 1e-6,
                                                  None, weight.dtype)
    q = _quantize_affine_tinygemm(weight, [1, GROUP], scale, zero, torch.int32, 0, 15).to(torch.uint8)
    q = q.reshape(n, k // GROUP, 2, GROUP // 2)  # a group's byte j: element j (low nibble), element j + 16 (high)
    scale, zero = scale.reshape(n, -1).float(), zero.reshape(n, -1).float()
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(n, k // 2), torch.stack([scale, zero - 136 * scale], 1)


class NativeInt4Linear(nn.Module):
    """Bias-free linears of one input, `weights` stacked into one product over `pack_int4`'s layout, run by
    `specdec_lowbit::int4_mm` (bf16 in and out). Each output row is computed alike whether stacked or not."""

    def __init__(self, *weights: torch.Tensor) -> None:
        super().__init__()
        weight = torch.cat([w.detach() for w in weights])
        self.out_features, self.in_features = weight.shape
        nibbles, scales = pack_int4(weight)
        self.qdata = nn.Parameter(nibbles.contiguous(), requires_grad=False)
        self.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        self.parts = len(weights)
        self._last: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (x, forward(x), parts yet to read it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = torch.ops.specdec_lowbit.int4_mm(x.reshape(-1, self.in_features), self.qdata, self.scales)
        return y.reshape(*x.shape[:-1], self.out_features)

    def once(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x), computed once for the `parts` that call it in turn on the same `x` (q, k, v): traced, the
        compiler's merge pass (`_merge_same_products`) makes their identical calls one; eager, the product is kept
        for the rest of the round only, so no later call can read it."""
        if torch.compiler.is_compiling():
            return self(x)
        if self._last is not None and self._last[0] is x:
            y, left = self._last[1], self._last[2] - 1
            self._last = (x, y, left) if left else None
            return y
        y = self(x)
        self._last = (x, y, self.parts - 1) if self.parts > 1 else None
        return y


class NativePart(nn.Module):
    """One linear of a stacked `NativeInt4Linear`: its rows [start, stop) of the shared product."""

    def __init__(self, stacked: NativeInt4Linear, start: int, stop: int) -> None:
        super().__init__()
        self.stacked, self.start, self.stop = stacked, start, stop
        self.in_features, self.out_features = stacked.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stacked.once(x)[..., self.start:self.stop]


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linears that read the same input in transformers' decoder layers: stacked into one product each."""


def _stack_siblings(model: nn.Module) -> None:
    """Replace each bias-free `SIBLINGS` group of one parent by `NativePart`s of one stacked product."""
    for parent in list(model.modules()):
        for names in SIBLINGS:
            linears = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, nn.Linear) and m.bias is None for m in linears) and \
                    len({m.in_features for m in linears}) == 1:
                stacked, start = NativeInt4Linear(*(m.weight for m in linears)), 0
                for name, linear in zip(names, linears):
                    setattr(parent, name, NativePart(stacked, start, start + linear.out_features))
                    start += linear.out_features


class NativeInt8Rows(Int8Rows):
    """`Int8Rows` whose logits come from `specdec_lowbit::int8_mm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return super().forward(x)
        y = torch.ops.specdec_lowbit.int8_mm(x.reshape(-1, self.in_features), self.qweight, self.scale)
        return y.reshape(*x.shape[:-1], self.out_features)


@backend("native_int4h8",
         description="torchao_int4h8's weights (int4 g32 body, int8 table) run by specdec's own CPU kernels (AVX-512 "
                     "BF16 dot products; built with the machine's C++ compiler on first use), bf16 activations",
         bits=(4,), grouped=True, group_sizes=(GROUP,), devices=("cpu",), library="torchao", extra="torchao",
         probe=_probe)
def apply_native_int4h8(model: nn.Module, spec: QuantSpec) -> nn.Module:
    load()
    model = model.to(torch.bfloat16)
    _stack_siblings(model)
    replace_linears(model, lambda name, linear: NativeInt4Linear(linear.weight) if linear.bias is None else linear)
    return int8_table(model, NativeInt8Rows)
