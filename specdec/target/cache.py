"""The KV-cache protocol of specdec and its full-attention implementation.

Owns: `Cache`, the small protocol every KV cache here follows (entries stored, *absolute* next
position, the two rollbacks speculative decoding needs, read access per layer), and `KVCache`, the
full cache over a Hugging Face `DynamicCache`. Knows nothing about drafts or acceptance.

Positions are absolute and belong to the cache, not to how many entries it stores: a lossy cache
(a window, a selection of tokens) stores fewer entries than the positions it has seen, and says so
through `evicted`. A forward of n new tokens reads `length` (how wide the attention mask is) and
`next_position` (where RoPE places them) and appends exactly n entries; nothing else moves it.
Rollback is always an explicit call by the cache's owner: `truncate` (a chain) or `keep` (the
accepted path of a tree), both in absolute positions.

Batch: every tensor keeps its batch dimension, but the bookkeeping (`evicted`) is one number, i.e.
B = 1 or rows that advance together; per-row lengths are the extension point for ragged batches.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from specdec.core.draft import KVLayers


@runtime_checkable
class Cache(Protocol):
    """What `Target.forward` and the loop need from a KV cache."""

    hf: object
    """The transformers cache object the model's attention layers write into."""

    @property
    def length(self) -> int:
        """Entries stored (the width of the attention mask's past)."""

    @property
    def next_position(self) -> int:
        """Absolute position of the next committed token: entries stored + entries evicted."""

    def truncate(self, position: int) -> None:
        """Drop every entry at absolute position >= `position` (chain rollback)."""

    def keep(self, start: int, offsets: list[int] | torch.Tensor) -> None:
        """Keep entries before absolute position `start`, then the block entries start + offsets
        (tree rollback; offsets index the block of entries appended since `start`)."""

    def tensors(self) -> KVLayers:
        """(keys, values) per layer, [B, kv_heads, S, head_dim]."""


def block_offsets(cache: Cache, start: int, offsets: list[int] | torch.Tensor) -> tuple[int, torch.Tensor]:
    """Check the arguments of `cache.keep(start, offsets)`: (stored index of absolute position
    `start`, offsets as a long tensor); ValueError when an offset falls outside the block."""
    offsets = torch.as_tensor(offsets, dtype=torch.long)
    begin = cache._index(start)
    if offsets.numel() and (int(offsets.min()) < 0 or begin + int(offsets.max()) >= cache.length):
        raise ValueError(f"keep offsets {offsets.tolist()} fall outside the cache block [{start}, {cache.next_position})")
    return begin, offsets


class KVCache:
    """The full cache (every position kept), optionally thinned by its owner with `retain`.

    Tensors per layer: [B, kv_heads, S, head_dim]. `evicted` counts committed entries dropped by
    `retain`; `next_position = evicted + length` because entries are only ever dropped from the
    committed prefix, never from the tail a rollback works on.
    """

    def __init__(self) -> None:
        self.hf = DynamicCache()
        self.evicted = 0

    @property
    def length(self) -> int:
        return self.hf.get_seq_length()

    @property
    def next_position(self) -> int:
        return self.evicted + self.length

    def _layers(self):
        return [layer for layer in self.hf.layers if getattr(layer, "is_initialized", False)]

    def _index(self, position: int) -> int:
        """Stored index of absolute position `position` in the tail (no eviction after it)."""
        index = position - self.evicted
        if not 0 <= index <= self.length:
            raise ValueError(f"position {position} is outside this cache's tail [{self.evicted}, "
                             f"{self.next_position}]: rollback works after the last evicted entry only")
        return index

    def truncate(self, position: int) -> None:
        length = self._index(position)
        if length == self.length:  # e.g. `keep` of a whole block (every plain step): nothing to drop
            return
        for layer in self._layers():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

    def keep(self, start: int, offsets: list[int] | torch.Tensor) -> None:
        """Example: the verifier appended a root and 5 draft nodes at stored entries 10..15 (no
        eviction) and accepted the root plus nodes 1 and 4, i.e. entries 0, 2 and 5 of the block:
        keep(10, [0, 2, 5]) leaves entries 0..9, 10, 12, 15 -> length 13, next position 13, equal
        to a prefill of those 13 tokens."""
        begin, offsets = block_offsets(self, start, offsets)
        n = offsets.numel()
        if torch.equal(offsets, torch.arange(n)):
            self.truncate(start + n)
            return
        self._select(torch.cat([torch.arange(begin), begin + offsets]))

    def retain(self, index: torch.Tensor) -> None:
        """Keep only the stored entries `index` (ascending), counting the others as evicted. For
        lossy policies (a window, selected tokens); the dropped entries must be committed ones."""
        index = torch.as_tensor(index, dtype=torch.long)
        self.evicted += self.length - index.numel()
        self._select(index)

    def _select(self, index: torch.Tensor) -> None:
        for layer in self._layers():
            idx = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)

    def tensors(self) -> KVLayers:
        return [(layer.keys, layer.values) for layer in self._layers()]

    def tail(self, count: int) -> KVLayers:
        """(keys, values) views of the last `count` stored entries per layer."""
        start = self.length - count
        return [(k[..., start:, :], v[..., start:, :]) for k, v in self.tensors()]

    def append(self, layers: KVLayers) -> None:
        """Append entries per layer (e.g. the target's exact K/V for committed tokens)."""
        for i, (k, v) in enumerate(layers):
            self.hf.update(k, v, i)

    def set_tensors(self, layers: KVLayers) -> None:
        """Replace every layer's (keys, values), e.g. with a transformed copy (same entry count)."""
        live = self._layers()
        if len(layers) != len(live):
            raise ValueError(f"set_tensors got {len(layers)} layers, the cache has {len(live)}")
        for layer, (k, v) in zip(live, layers):
            layer.keys, layer.values = k, v
