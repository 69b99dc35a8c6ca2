"""Static-shape target forwards: width buckets over a preallocated cache, captured as CUDA graphs.

Owns `StaticForward` (the verifier's forward of one target as a fixed set of static-shape programs, one per width
bucket), `check_buckets`, and `static_forward`, which keeps one `StaticForward` per target so graphs are captured
once, not once per generation. Knows nothing about drafts or acceptance: it is given tokens and their tree
`parents`, as `Target.forward` is.

n new tokens are padded to the smallest bucket W >= n (pad rows attend to entry 0 only, no row attends to them, and
the next forward overwrites their entries); positions and the tree mask are rebuilt in place with no host sync.
`capture` is `cuda_graph` (the default on CUDA), `compile` (`torch.compile`) or `eager` (elsewhere: the very same
function, so CI on a CPU tests everything but the capture itself). A compiled forward attends to the entries
written so far only, and its width (2 and up), attended entries and capacity are symbolic: two programs per model
(width 1, width 2+) serve every bucket, prompt and `StaticForward` of a process. A new process traces them again
(~10 s each for a 135M model on one core); inductor's and AOTAutograd's on-disk caches spare the rest.
"""

from __future__ import annotations

import functools
import os
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec import machine
from specdec.core import tree as tree_ops
from specdec.runtime.kernels import kernel_in_use
from specdec.runtime.model import ForwardOut, Target, tree_block
from specdec.runtime.static_cache import StaticKVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Verification widths a `StaticForward` runs at by default: a forward of n tokens runs at the
smallest one >= n."""
CAPTURES = ("cuda_graph", "compile", "eager")
COMPILE_OPTIONS = {"freezing": False, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
"""`torch.compile` options of `capture="compile"`. No freezing: it saved no measurable time per forward, and its
programs bypass AOTAutograd's on-disk cache, so every process paid ~20 s more per program (smollm2-135m, one core).
No guards on the model's modules (checking them cost a measurable share of a small model's step): each model and
weights signature has a code object of its own (`_own_code`), so a program never meets modules other than those it
was traced on."""


def check_buckets(buckets: Sequence[int], widest: int) -> tuple[int, ...]:
    """`buckets` as an ascending tuple, or ValueError: not distinct integers >= 1, or none covers a
    forward of `widest` tokens (the root plus the largest draft the shape can propose)."""
    values = tuple(buckets)
    if not values or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in values) \
            or list(values) != sorted(set(values)):
        raise ValueError(f"width buckets must be distinct ascending integers >= 1, got {values!r}")
    if values[-1] < widest:
        raise ValueError(f"width buckets {values} do not cover the widest verification: {widest} tokens "
                         f"(the root + {widest - 1} draft nodes); add a bucket >= {widest}")
    return values


@dataclass
class _Bucket:
    """The static inputs of one width W and the forward that reads them."""

    ids: torch.Tensor  # [1, W] long
    positions: torch.Tensor  # [1, W] long
    mask: torch.Tensor  # [1, 1, W, C] additive
    slots: torch.Tensor  # [W] long: cache slots the W rows write
    run: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
    """run(columns attended): the forward on the buffers above: (logits [1, W, V], hidden [1, W, H], aux or None)."""

    def inputs(self, columns: int | None = None) -> tuple[torch.Tensor, ...]:
        return self.ids, self.positions, self.mask[..., :columns], self.slots


class _Attended:
    """A slot writer whose `update` returns the cache's first `columns` entries only (what the mask covers)."""

    def __init__(self, writer, columns) -> None:
        self.writer, self.columns = writer, columns

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.writer.update(keys, values, layer_idx)
        return k[:, :, :self.columns], v[:, :, :self.columns]


class StaticForward:
    """A target's forwards over one preallocated `StaticKVCache`, padded to width buckets."""

    def __init__(self, target: Target, capacity: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 capture: str | None = None) -> None:
        capture = capture or ("cuda_graph" if target.device.type == "cuda" else "eager")
        if capture not in CAPTURES:
            raise ValueError(f"unknown capture {capture!r}; expected one of {', '.join(CAPTURES)}")
        if capture == "compile" and kernel_in_use(target.model) != "torch":
            raise ValueError(f"capture='compile' compiles the torch kernel's plain linears; {target.label!r} runs "
                             f"the {kernel_in_use(target.model)!r} kernel: load it with kernel='torch'")
        if capture == "compile":  # inductor's C++ code lands in the on-disk cache: paid once per machine
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(machine.cache_root() / "inductor")
            # a model's StaticForwards share its code object (`_own_code`), whose entries dynamo caps at 8 by default;
            # past the cap (weights swapped, other owners) it would run the forward eagerly without a word
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
        if capture == "cuda_graph" and target.device.type != "cuda":
            raise ValueError(f"capture='cuda_graph' needs a CUDA target, {target.label!r} is on {target.device}")
        self.buckets = check_buckets(buckets, 1)
        if capacity < self.buckets[-1]:
            raise ValueError(f"a static forward's capacity ({capacity}) must hold its widest bucket ({self.buckets[-1]})")
        self._target = weakref.ref(target)  # weak: `_FORWARDS` is keyed weakly by the target's model
        self.capacity, self.capture = capacity, capture
        self.aux_layers = target.aux_layers  # fixed: a captured graph returns these hidden states or none
        self.cache = StaticKVCache(capacity)
        target.forward(torch.zeros(1, 1, dtype=torch.long), self.cache)  # allocates the buffers
        self.cache.reset()
        if capture == "compile":  # transformers hooks its hidden states in at a first such forward, under a lock
            # dynamo does not trace (the program would break into a graph per layer): this forward does it eagerly
            target.base(input_ids=torch.zeros(1, 1, dtype=torch.long, device=target.device), output_hidden_states=True)
            for t in (*self.cache.keys, *self.cache.values):
                torch._dynamo.maybe_mark_dynamic(t, 2)  # the capacity: one program serves any
        device = target.device
        self.dtype = target.base.get_input_embeddings().weight.dtype
        self.columns = torch.arange(capacity, device=device)  # [C]
        self.signature = weights_signature(target)
        self._bucket: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture == "cuda_graph" else None
        self._program = torch.compile(types.MethodType(_own_code(target.model, self.signature), self), dynamic=False,
                                      options=dict(COMPILE_OPTIONS)) if capture == "compile" else None

    @property
    def target(self) -> Target:
        target = self._target()
        if target is None:
            raise RuntimeError("this StaticForward's target is gone; get a new one from static_forward(target, ...)")
        return target

    def open(self) -> StaticKVCache:
        """The cache for a new generation: this forward's own, emptied (its buffers stay put)."""
        self.cache.reset()
        return self.cache

    def bucket(self, n: int) -> int:
        """The width a forward of n tokens runs at; ValueError when no bucket holds n."""
        for width in self.buckets:
            if width >= n:
                return width
        raise ValueError(f"a forward of {n} tokens exceeds the widest bucket {self.buckets[-1]} (buckets {self.buckets})")

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: StaticKVCache, parents: torch.Tensor | None = None,
                logits_rows: slice | torch.Tensor | None = None) -> ForwardOut:
        """As `Target.forward`, for this object's cache. A forward wider than the widest bucket (a
        model drafter feeding a prompt) runs eagerly through `Target.forward` into the same cache."""
        if cache is not self.cache:
            raise ValueError("StaticForward.forward runs on its own cache only (take it from `open()`)")
        batch, n = tokens.shape
        if batch != 1:
            raise NotImplementedError(f"specdec runs batch size 1 only, got B = {batch}")
        if n > self.buckets[-1]:
            return self.target.forward(tokens, cache, parents, logits_rows)
        parents = tree_ops.chain_parents(n) if parents is None else tree_ops.as_parents(parents)
        width = self.bucket(n)
        past = cache.length
        if past + width > self.capacity:
            raise ValueError(f"static cache overflow: {past} entries + a {width}-wide bucket > capacity {self.capacity}")
        b = self._bucket.get(width) or self._new_bucket(width)
        # compiled: attends to the entries written so far only (>= 2: a size of 1 would be a program of its own)
        columns = min(self.capacity, max(past + width, 2)) if self.capture == "compile" else self.capacity
        self._fill(b, tokens, parents, past, cache.next_position, columns)
        if b.run is None:
            b.run = self._capture(b)
        logits, hidden, aux = b.run(columns)  # graph outputs: overwritten by the next replay, so copied here
        cache.advance(n)
        logits = logits[:, :n] if logits_rows is None else logits[:, :n][:, logits_rows]
        return ForwardOut(logits=logits.clone(), hidden=hidden[:, :n].clone(),
                          aux=None if aux is None else aux[:, :n].clone())

    def _new_bucket(self, width: int) -> _Bucket:
        device = self.target.device
        b = _Bucket(ids=torch.zeros(1, width, dtype=torch.long, device=device),
                    positions=torch.zeros(1, width, dtype=torch.long, device=device),
                    mask=torch.zeros(1, 1, width, self.capacity, dtype=self.dtype, device=device),
                    slots=torch.arange(width, device=device))
        self._bucket[width] = b
        return b

    def _fill(self, b: _Bucket, tokens: torch.Tensor, parents: torch.Tensor, past: int, next_position: int,
              columns: int) -> None:
        """Write this step's inputs into bucket b's buffers, on the device; the mask's first `columns` only."""
        n, m, device = tokens.shape[1], parents.numel(), b.ids.device
        block_start, positions, visible = tree_block(parents.to(device, non_blocking=True), n, past, next_position)
        b.ids[:, :n] = tokens.to(device, non_blocking=True)
        b.positions[0, :n] = positions
        b.positions[0, n:] = next_position
        torch.add(self.columns[: b.slots.numel()], past, out=b.slots)
        mask = b.mask[0, 0, :, :columns]  # [W, columns]
        mask.fill_(torch.finfo(self.dtype).min)
        mask[:n, :block_start] = 0  # the prefix before the block
        mask[:n, block_start:block_start + m].masked_fill_(visible, 0)  # ancestors within the block
        mask[n:, 0] = 0  # pad rows: entry 0 only (slot `past` at an empty cache: their own root's)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                 every_layer: bool = False):
        """The program a bucket runs: reads only its inputs and the cache's buffers (never a host value); attends
        to the cache's first mask.shape[-1] entries. (logits, hidden, aux: `aux_layers`' states, or every layer's)"""
        target = self.target
        out = target.base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                          cache=_Attended(self.cache.slot_writer(slots), mask.shape[-1]),
                          output_hidden_states=every_layer or bool(self.aux_layers))
        hidden = out.last_hidden_state  # [1, W, H]
        aux = torch.cat([out.hidden_states[k] for k in self.aux_layers], -1) if self.aux_layers else None
        return target.logits(hidden), hidden, out.hidden_states if every_layer else aux

    def _compiled(self, b: _Bucket, columns: int):
        """Bucket b's forward through `torch.compile`, whose width (from 2), attended columns and capacity are symbolic
        and which returns every layer's states: two programs per model (width 1, and 2 and up) serve every bucket,
        cache length, aux layers and `StaticForward`."""
        inputs = b.inputs(columns)
        for t, dims in zip(inputs, ((1,), (1,), (2, 3), (0,))):
            torch._dynamo.maybe_mark_dynamic(t, dims)
        programs, key = _COMPILED.setdefault(self.target.model, set()), (b.ids.shape[1] > 1, hash(self.signature))
        if key not in programs:  # a new program: say so, so that a first run never pays silently
            programs.add(key)
            print(f"specdec: compiling {self.target.label}'s forward at width {'1' if b.ids.shape[1] == 1 else '2+'} "
                  f"(torch.compile; inductor's cache: {os.environ['TORCHINDUCTOR_CACHE_DIR']})", file=sys.stderr,
                  flush=True)
        logits, hidden, states = self._program(*inputs, every_layer=True)
        return logits, hidden, torch.cat([states[k] for k in self.aux_layers], -1) if self.aux_layers else None

    def _capture(self, b: _Bucket) -> Callable:
        if self.capture == "eager":
            return lambda columns: self._forward(*b.inputs())
        if self.capture == "compile":
            return functools.partial(self._compiled, b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-ups: library handles and workspaces are created outside the capture
                self._forward(*b.inputs())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outs = self._forward(*b.inputs())

        def replay(columns):
            graph.replay()
            return outs

        return replay


def weights_signature(target: Target) -> tuple:
    """Addresses and shapes of the target's parameters and buffers, and its modules' classes: a captured graph reads
    weights at these addresses, and a compiled one runs the modules it was traced on, so a target whose modules were
    swapped (kernels, quantization, a module wrapped around the same weights) needs new ones."""
    model = target.model
    return (*((_address(t), tuple(t.shape), t.dtype) for t in (*model.parameters(), *model.buffers())),
            tuple(map(type, model.modules())))


def _address(t: torch.Tensor) -> int:
    """Storage address, or the object's id for tensor subclasses without one (quantized weights)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)


def _own_code(model, signature: tuple) -> Callable:
    """`StaticForward._forward` over a code object of `model`'s own, one per weights signature. dynamo keeps compiled
    programs per code object and, each call, checks their guards in turn until one passes: with one code object for
    every model, a forward of one model first failed the guards of every other model's programs in the process (a
    grid holds several). Their guards skip the model's modules (`COMPILE_OPTIONS`): swapped modules (quantized,
    another kernel) change the signature, and so get a code object, and programs, of their own."""
    f = StaticForward._forward
    code = _CODES.setdefault(model, {}).setdefault(hash(signature), f.__code__.replace())  # equal code, another object
    return types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)


_CODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {weights: its code object of `_forward`}
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(width > 1, weights) compiled}
_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {owner: StaticForward}


def static_forward(target: Target, capacity: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                   capture: str | None = None, owner: str = "verifier") -> StaticForward:
    """The target's `StaticForward` with at least `capacity` entries, built (capacity rounded up to
    a multiple of 256, so later prompts of similar length reuse it) or reused. One is kept per model
    and `owner` (the verifier's, a drafter's: a self-drafter may run the target's own model): a
    request it cannot serve (more capacity, other buckets, aux layers or weights) replaces it."""
    buckets = check_buckets(buckets, 1)
    owners = _FORWARDS.setdefault(target.model, {})
    kept = owners.get(owner)
    if (kept is not None and kept.capacity >= capacity and kept.buckets == buckets
            and kept.capture == (capture or kept.capture) and kept.aux_layers == target.aux_layers
            and kept.signature == weights_signature(target)):
        kept._target = weakref.ref(target)
        return kept
    owners.pop(owner, None)  # free the old graphs and cache before allocating new ones
    rounded = -(-max(capacity, buckets[-1]) // 256) * 256
    made = StaticForward(target, min(rounded, max(capacity, target.context_length + buckets[-1])), buckets, capture)
    owners[owner] = made
    return made
