"""The (cache, forward) pairs a generation runs its target on: `CACHES`, `resolve_cache`, `verification_width` and
`drafter_cache`. The loop and `specdec.measure.latency` share it, so a curve times the forward the loop runs. Knows
nothing about drafts or acceptance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from specdec import machine
from specdec.runtime.cache import Cache, KVCache
from specdec.runtime.graphs import DEFAULT_BUCKETS, check_buckets, static_forward
from specdec.runtime.model import ForwardOut, Target
from specdec.runtime.static_cache import StaticKVCache

Forward = Callable[[torch.Tensor, Cache, torch.Tensor], ForwardOut]
"""forward(tokens [B, n], cache, parents [M]) -> ForwardOut, appending n entries (`Target.forward`)."""


def _graphs(target: Target, capacity: int, buckets: tuple[int, ...], owner: str = "verifier",
            capture: str | None = None) -> tuple[Cache, Forward]:
    runner = static_forward(target, capacity, buckets, capture, owner)
    return runner.open(), runner.forward


CACHES: dict[str, Callable[..., tuple[Cache, Forward]]] = {
    "dynamic": lambda target, capacity, buckets, owner=None: (KVCache(), target.forward),
    "static": lambda target, capacity, buckets, owner=None: (StaticKVCache(capacity), target.forward),
    "graphs": _graphs,
    "compiled": functools.partial(_graphs, capture="compile"),
}
"""(cache, forward) per `generate(cache=...)`, from (target, capacity, buckets, owner): `dynamic` grows as it goes
(HF DynamicCache); `static` preallocates `capacity` entries per layer (prompt + max_new_tokens + draft nodes by
default); `graphs` is `specdec.runtime.graphs.StaticForward`: a preallocated cache kept with the target per `owner`
(the loop's, a curve's), forwards padded to width `buckets`, captured as CUDA graphs on CUDA (run eagerly elsewhere);
`compiled` is the same through `torch.compile` (inductor). `auto` (the default) is
`graphs` on CUDA, elsewhere the kind `python -m specdec.tune --compile` stored, else `dynamic`."""


def resolve_cache(cache: str, target: Target, rows: int = 1) -> str:
    """The `CACHES` key `generate_batch(cache=...)` runs `rows` prompts with: `auto` -> `static` for a batch (a
    growing cache copies every row at every step), else `graphs` on CUDA and the tuned kind (`dynamic`) on CPU."""
    if cache == "auto":
        if rows > 1 or target.device.type == "cuda":
            return "static" if rows > 1 else "graphs"
        tuned = (machine.load_record(target.label, target.device, target.dtype) or {}).get("cache") or {}
        return tuned.get("cache", "dynamic")
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r}; expected auto or one of {', '.join(CACHES)}")
    return cache


def verification_width(cache: str, widest: int, buckets: Sequence[int] | None) -> tuple[int, tuple[int, ...]]:
    """(entries the widest verification writes, the width buckets) for a resolved `cache` kind.
    Given buckets must cover `widest` (root + most draft nodes); the default set is widened to."""
    if cache not in ("graphs", "compiled"):
        if buckets is not None:
            raise ValueError(f"buckets={tuple(buckets)} apply to cache='graphs' or 'compiled' only, got {cache!r}")
        return widest, ()
    if buckets is None:
        buckets = DEFAULT_BUCKETS + tuple(1 << k for k in range(8, (widest - 1).bit_length() + 1))
    buckets = check_buckets(buckets, widest)
    return next(b for b in buckets if b >= widest), buckets


def drafter_cache_kind(model: Target, cache: str = "auto", evicts: bool = False) -> str:
    """The `CACHES` key a model drafter's cache resolves to: `auto` -> `graphs` on CUDA unless it `evicts`, else
    `dynamic`; ValueError for an unknown kind or a preallocated one for an evicting drafter."""
    kind = resolve_cache(cache, model)
    if cache == "auto" and evicts:
        return "dynamic"
    if kind != "dynamic" and evicts:
        raise ValueError(f"cache={cache!r} preallocates the draft cache, which never evicts; this drafter's KV "
                         "policy evicts entries: use cache='dynamic' (or 'auto')")
    return kind


def drafter_cache(model: Target, cache: str = "auto", evicts: bool = False) -> tuple[Cache, Forward]:
    """A model drafter's own (cache, forward) for a new generation (kind: `drafter_cache_kind`); preallocated kinds
    hold the context length plus two widest buckets."""
    kind = drafter_cache_kind(model, cache, evicts)
    if kind == "dynamic":
        return KVCache(), model.forward
    capacity = model.context_length + 2 * DEFAULT_BUCKETS[-1]
    if kind == "static":
        return StaticKVCache(capacity), model.forward
    runner = static_forward(model, capacity, DEFAULT_BUCKETS, owner="drafter")
    return runner.open(), runner.forward
