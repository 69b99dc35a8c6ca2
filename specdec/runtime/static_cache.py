"""A preallocated (static) KV cache: fixed-capacity buffers written in place, never reallocated.

Owns `StaticKVCache`, which follows the `specdec.runtime.cache.Cache` protocol over per-layer buffers
[B, kv_heads, capacity, head_dim] allocated on the first write. `hf` forwards append at the stored length; a
static-shape forward (`specdec.runtime.graphs`) writes through `slot_writer(slots)` then calls `advance(n)`.
Batches keep holes per row as in `RowBook`. Knows nothing about drafts, acceptance or eviction (`evicted` stays 0).
"""

from __future__ import annotations

import weakref

import torch

from specdec.runtime.cache import RowBook, _or_none, block_offsets
from specdec.core.draft import KVLayers


class _Writer:
    """What the transformers attention layers call: `update` writes a layer's new entries in place.
    Holds its cache weakly: the cache holds it (`hf`), and a reference cycle would keep the buffers
    (gigabytes for a batch) alive until Python's cycle collector happens to run."""

    def __init__(self, owner: StaticKVCache) -> None:
        self._owner = weakref.ref(owner)

    @property
    def owner(self) -> StaticKVCache:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("this static cache's writer outlived its cache: keep the StaticKVCache, not only its .hf")
        return owner

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.owner._write(layer_idx, keys, values)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.owner.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Stored index of the first new token (the causal mask's query offset)."""
        return self.owner.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv length, kv offset) of the causal mask for `query_length` new tokens."""
        return self.owner.length + query_length, 0


class _SlotWriter:
    """What the attention layers call in a static-shape forward: `update` writes the W new entries
    at `slots` ([W] long, on the buffers' device) and returns the whole [B, kv_heads, capacity, D]
    buffers, so nothing in the forward depends on the stored length."""

    def __init__(self, owner: StaticKVCache, slots: torch.Tensor) -> None:
        self.owner, self.slots = owner, slots

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.owner.keys[layer_idx], self.owner.values[layer_idx]
        k.index_copy_(2, self.slots, keys)
        v.index_copy_(2, self.slots, values)
        return k, v


class StaticKVCache(RowBook):
    """Fixed-capacity full cache (every position kept). Tensors per layer: [B, kv_heads, S, head_dim]."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"a static cache needs a capacity >= 1 entries, got {capacity!r}")
        self.capacity = capacity
        self.hf = _Writer(self)
        self.evicted = 0
        self.valid = None
        self.keys: list[torch.Tensor] = []  # per layer [B, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # entries written per layer (equal between forwards)

    @staticmethod
    def over(keys: list[torch.Tensor], values: list[torch.Tensor], length: int) -> StaticKVCache:
        """A cache over buffers the caller filled (per layer [B, kv_heads, capacity, head_dim]) whose
        first `length` entries are stored, e.g. a batch of prompts prefilled one at a time."""
        cache = StaticKVCache(keys[0].shape[-2])
        cache.keys, cache.values, cache.lengths = list(keys), list(values), [length] * len(keys)
        return cache

    @property
    def length(self) -> int:
        return self.lengths[0] if self.lengths else 0

    @property
    def batch(self) -> int:
        """Rows stored (1 before the first write)."""
        return self.keys[0].shape[0] if self.keys else (1 if self.valid is None else self.valid.shape[0])

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def reset(self) -> None:
        """Forget every entry, keeping the buffers (and so their addresses)."""
        self.lengths = [0] * len(self.lengths)
        self.valid = None

    def slot_writer(self, slots: torch.Tensor) -> _SlotWriter:
        """The cache object for a static-shape forward writing at `slots` ([W] long, device); needs
        the buffers allocated (by any earlier forward through `hf`)."""
        if not self.allocated:
            raise ValueError("a static-shape forward needs the static cache's buffers: run one forward "
                             "through `cache.hf` first (it allocates them)")
        return _SlotWriter(self, slots)

    def advance(self, n: int) -> None:
        """Count n more entries as stored: the real rows a static-shape forward wrote at slots
        length .. length + n - 1 (its padding rows beyond them stay unstored)."""
        if self.length + n > self.capacity:
            raise ValueError(f"static cache overflow: {self.length} entries + {n} new > capacity {self.capacity}")
        self.lengths = [self.length + n] * len(self.lengths)

    def _write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append keys/values [B, kv_heads, n, head_dim] to `layer`; the layer's filled views."""
        if layer == len(self.keys):
            shape = (*keys.shape[:2], self.capacity, keys.shape[-1])
            self.keys.append(keys.new_zeros(shape))  # zeros, not empty: a static-shape forward reads
            self.values.append(values.new_zeros(shape))  # every slot, and 0 x NaN garbage would be NaN
            self.lengths.append(0)  # buffers are allocated by the first forward, before any entry
        start, n = self.lengths[layer], keys.shape[-2]
        if start + n > self.capacity:
            raise ValueError(f"static cache overflow: {start} entries + {n} new > capacity {self.capacity}; "
                             "build it with a capacity of at least prompt + max_new_tokens + draft nodes + 1")
        self.keys[layer][..., start:start + n, :] = keys
        self.values[layer][..., start:start + n, :] = values
        self.lengths[layer] = start + n
        return self.keys[layer][..., :start + n, :], self.values[layer][..., :start + n, :]

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` ([b'] long, ascending): a batch whose finished rows leave it.
        The kept rows move to the front of the same buffers, which stay allocated (views of their
        first b' rows), so a shrinking batch never holds two copies of its cache."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                index = rows.to(buf.device)
                buf[: len(index)] = buf.index_select(0, index)  # gather first, then write
                buffers[i] = buf[: len(index)]
        if self.valid is not None:
            self.valid = _or_none(self.valid.index_select(0, rows.cpu()))
        if isinstance(self.evicted, torch.Tensor):
            self.evicted = self.evicted.index_select(0, rows.cpu())

    def _index(self, position: int) -> int:
        if not isinstance(self.evicted, int) or self.valid is not None:
            raise ValueError("absolute positions differ between this cache's rows: use keep_rows / stored indices")
        index = position - self.evicted
        if not 0 <= index <= self.length:
            raise ValueError(f"position {position} is outside this cache [{self.evicted}, {self.next_position}]")
        return index

    def truncate(self, position: int) -> None:
        self._truncate_stored(self._index(position))

    def _truncate_stored(self, length: int) -> None:
        self.lengths = [length] * len(self.lengths)
        if self.valid is not None:
            self.valid = _or_none(self.valid[:, :length])

    @torch.inference_mode()
    def keep_rows(self, begin: int, offsets: list[list[int]]) -> None:
        """As `KVCache.keep_rows`: per row, the kept block entries move to the block's front in place."""
        index, real = self._check_rows(begin, offsets)
        width = index.shape[1]
        if not (bool(real.all()) and torch.equal(index, torch.arange(width).expand_as(index))):
            for buffers in (self.keys, self.values):
                for buf in buffers:
                    gather = index.to(buf.device)[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[-1])
                    buf[..., begin:begin + width, :] = buf[..., begin:self.length, :].gather(2, gather)
            self._kept_valid(begin, index, real)
        self._truncate_stored(begin + width)

    def keep(self, start: int, offsets: list[int] | torch.Tensor) -> None:
        """As `KVCache.keep`: entries before `start`, then block entries start + offsets. Example:
        block at entries 10..15, keep(10, [0, 2, 5]) copies entries 10, 12, 15 to 10, 11, 12."""
        begin, offsets = block_offsets(self, start, offsets)
        n = offsets.numel()
        if not torch.equal(offsets, torch.arange(n)):
            self._gather(begin, offsets)
        self.lengths = [begin + n] * len(self.lengths)

    @torch.inference_mode()  # the buffers were made by an inference-mode forward
    def _gather(self, begin: int, offsets: torch.Tensor) -> None:
        n = offsets.numel()
        for buffers in (self.keys, self.values):
            for buf in buffers:
                rows = (begin + offsets).to(buf.device)
                buf[..., begin:begin + n, :] = buf.index_select(-2, rows)  # gather first, then write

    def tensors(self) -> KVLayers:
        return [(k[..., :n, :], v[..., :n, :]) for k, v, n in zip(self.keys, self.values, self.lengths)]

    def tail(self, count: int) -> KVLayers:
        """(keys, values) views of the last `count` stored entries per layer."""
        start = self.length - count
        return [(k[..., start:, :], v[..., start:, :]) for k, v in self.tensors()]

    @torch.inference_mode()
    def append(self, layers: KVLayers) -> None:
        """Append entries per layer (e.g. a drafter copying the target's committed K/V)."""
        for i, (k, v) in enumerate(layers):
            self._write(i, k, v)
