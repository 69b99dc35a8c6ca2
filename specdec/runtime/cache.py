"""The KV-cache protocol of specdec and its full-attention implementation.

Owns: `Cache`, the small protocol every KV cache here follows (entries stored, *absolute* next
position, the two rollbacks speculative decoding needs, read access per layer), and `KVCache`, the
full cache over a Hugging Face `DynamicCache`. Knows nothing about drafts or acceptance.

Positions are absolute and belong to the cache (a lossy cache has `evicted` some). A forward of n new tokens appends
exactly n entries; rollback is the owner's call, `truncate` (a chain) or `keep` (a tree's accepted path). Batches
(`RowBook`): rows share one stored length S; a row's *holes* are marked invalid in `valid` [B, S] and masked out.
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
        """Keep entries before absolute position `start`, then the block entries start + offsets (tree rollback; offsets
        index the block of entries appended since `start`)."""

    def tensors(self) -> KVLayers:
        """(keys, values) per layer, [B, kv_heads, S, head_dim]."""


class RowBook:
    """Per-row bookkeeping of a batched cache: holes (`valid`) and per-row positions. Mixed into
    `KVCache` and `StaticKVCache`, which provide `length`, `batch`, `_index` and their storage."""

    valid: torch.Tensor | None = None
    """[B, S] bool: which stored entries are real (False = a hole, masked for every query). None = all."""
    evicted: int | torch.Tensor = 0
    """Entries dropped from the committed prefix: one number, or [B] long when rows evict differently."""

    @property
    def next_positions(self) -> torch.Tensor:
        """[B] long: each row's absolute next position (valid entries stored + entries evicted);
        [1] before the first write of a cache that never saw a batch."""
        rows = self.batch
        stored = self.valid.sum(1) if self.valid is not None else torch.full((rows,), self.length, dtype=torch.long)
        return stored + self.evicted

    @property
    def next_position(self) -> int:
        """Absolute position of the next committed token, the same for every row (else ValueError:
        rows at different positions read `next_positions`)."""
        if self.valid is None and isinstance(self.evicted, int):
            return self.evicted + self.length
        positions = self.next_positions
        if not bool((positions == positions[0]).all()):
            raise ValueError(f"this cache's rows are at different positions {positions.tolist()}: read next_positions")
        return int(positions[0])

    def append_valid(self, new: torch.Tensor | None, count: int) -> None:
        """Record which of the `count` entries a forward just appended are real (`new` [B, count]
        bool; None = all). Called by `Target.forward` after the model wrote them."""
        if new is None and self.valid is None:
            return
        rows = self.batch if new is None else new.shape[0]
        old = self.valid if self.valid is not None else torch.ones(rows, self.length - count, dtype=torch.bool)
        new = torch.ones(rows, count, dtype=torch.bool) if new is None else new.to(torch.bool).cpu()
        self.valid = _or_none(torch.cat([old, new], 1))

    def _check_rows(self, begin: int, offsets: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(index [B, K], real [B, K]) of `keep_rows`' offsets padded to the longest row; ValueError
        for a wrong row count or an offset outside the block."""
        unwritten = self.length == 0 and not any(offsets)  # e.g. a drafter's head before its first forward
        if len(offsets) != self.batch and not unwritten:
            raise ValueError(f"keep_rows got offsets for {len(offsets)} rows, the cache holds {self.batch}")
        width = max(len(o) for o in offsets)
        index = torch.zeros(len(offsets), width, dtype=torch.long)
        real = torch.zeros(len(offsets), width, dtype=torch.bool)
        for row, kept in enumerate(offsets):
            kept = torch.as_tensor(kept, dtype=torch.long)
            if kept.numel() and (int(kept.min()) < 0 or begin + int(kept.max()) >= self.length):
                raise ValueError(f"row {row}: keep offsets {kept.tolist()} fall outside the block [{begin}, {self.length})")
            index[row, : kept.numel()], real[row, : kept.numel()] = kept, True
        return index, real

    def _kept_valid(self, begin: int, index: torch.Tensor, real: torch.Tensor) -> None:
        """`valid` after `keep_rows` moved each row's kept block entries to the block's front."""
        rows = index.shape[0]
        before = self.valid[:, :begin] if self.valid is not None else torch.ones(rows, begin, dtype=torch.bool)
        block = self.valid[:, begin:].gather(1, index) if self.valid is not None else torch.ones_like(real)
        self.valid = _or_none(torch.cat([before, block & real], 1))


def _or_none(valid: torch.Tensor) -> torch.Tensor | None:
    """A valid mask, or None when it has no hole."""
    return None if bool(valid.all()) else valid


def block_offsets(cache: Cache, start: int, offsets: list[int] | torch.Tensor) -> tuple[int, torch.Tensor]:
    """Check the arguments of `cache.keep(start, offsets)`: (stored index of absolute position
    `start`, offsets as a long tensor); ValueError when an offset falls outside the block."""
    offsets = torch.as_tensor(offsets, dtype=torch.long)
    begin = cache._index(start)
    if offsets.numel() and (int(offsets.min()) < 0 or begin + int(offsets.max()) >= cache.length):
        raise ValueError(f"keep offsets {offsets.tolist()} fall outside the cache block [{start}, {cache.next_position})")
    return begin, offsets


class KVCache(RowBook):
    """The full cache (every position kept), optionally thinned by its owner with `retain`.

    Tensors per layer: [B, kv_heads, S, head_dim]. `evicted` counts committed entries dropped by
    `retain`; `next_position = evicted + length` because entries are only ever dropped from the
    committed prefix, never from the tail a rollback works on.
    """

    def __init__(self) -> None:
        self.hf = DynamicCache()
        self.evicted = 0
        self.valid = None

    @property
    def length(self) -> int:
        return self.hf.get_seq_length()

    @property
    def batch(self) -> int:
        """Rows stored (1 before the first write)."""
        layers = self._layers()
        return layers[0].keys.shape[0] if layers else (1 if self.valid is None else self.valid.shape[0])

    def _layers(self):
        return [layer for layer in self.hf.layers if getattr(layer, "is_initialized", False)]

    def _index(self, position: int) -> int:
        """Stored index of absolute position `position` in the tail (no eviction after it)."""
        if not isinstance(self.evicted, int) or self.valid is not None:
            raise ValueError("absolute positions differ between this cache's rows: use keep_rows / stored indices")
        index = position - self.evicted
        if not 0 <= index <= self.length:
            raise ValueError(f"position {position} is outside this cache's tail [{self.evicted}, "
                             f"{self.next_position}]: rollback works after the last evicted entry only")
        return index

    def truncate(self, position: int) -> None:
        length = self._index(position)
        if length == self.length:  # e.g. `keep` of a whole block (every plain step): nothing to drop
            return
        self._truncate_stored(length)

    def keep(self, start: int, offsets: list[int] | torch.Tensor) -> None:
        """E.g. after a 6-entry block at 10..15, keep(10, [0, 2, 5]) leaves entries 0..9, 10, 12, 15 (length 13)."""
        begin, offsets = block_offsets(self, start, offsets)
        n = offsets.numel()
        if torch.equal(offsets, torch.arange(n)):
            self.truncate(start + n)
            return
        self._select(torch.cat([torch.arange(begin), begin + offsets]))

    @torch.inference_mode()  # the entries were made by inference-mode forwards
    def keep_rows(self, begin: int, offsets: list[list[int]]) -> None:
        """Per-row `keep` of a batch: row b keeps the stored entries before `begin` (a stored index, the block's start,
        common to all rows) and block entries begin + offsets[b], moved to the front of the block; slots past a row's
        last kept entry become holes. The stored length becomes begin + the longest row's count. The block is rewritten
        in place (one gather per layer), never the prefix."""
        index, real = self._check_rows(begin, offsets)
        width = index.shape[1]
        if bool(real.all()) and torch.equal(index, torch.arange(width).expand_as(index)):
            self._truncate_stored(begin + width)
            return
        for layer in self._layers():
            for name in ("keys", "values"):
                buf = getattr(layer, name)
                gather = index.to(buf.device)[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[-1])
                moved = buf[..., begin:, :].gather(2, gather)  # [B, kv_heads, K, D], gathered before writing
                buf[..., begin:begin + width, :] = moved
                setattr(layer, name, buf[..., :begin + width, :])
        self._kept_valid(begin, index, real)

    def _truncate_stored(self, length: int) -> None:
        for layer in self._layers():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
        if self.valid is not None:
            self.valid = _or_none(self.valid[:, :length])

    @torch.inference_mode()
    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only the batch rows `rows` (a batch whose finished rows leave it); slots that are holes
        in every remaining row are dropped."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        columns = None
        if self.valid is not None:
            self.valid = self.valid.index_select(0, rows)
            if not bool(self.valid.any(0).all()):
                columns = self.valid.any(0).nonzero().flatten()
                self.valid = self.valid[:, columns]
            self.valid = _or_none(self.valid)
        if isinstance(self.evicted, torch.Tensor):
            self.evicted = self.evicted.index_select(0, rows)
        for layer in self._layers():
            for name in ("keys", "values"):
                buf = getattr(layer, name).index_select(0, rows.to(layer.keys.device))
                setattr(layer, name, buf if columns is None else buf.index_select(-2, columns.to(buf.device)))

    def retain(self, index: torch.Tensor) -> None:
        """Keep only the stored entries `index` (ascending), counting the others as evicted. For
        lossy policies (a window, selected tokens); the dropped entries must be committed ones."""
        index = torch.as_tensor(index, dtype=torch.long)
        self.evicted += self.length - index.numel()
        self._select(index)

    @torch.inference_mode()
    def retain_rows(self, index: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """`retain` per row of a batch: row b keeps stored entries index[b] ([B, K] long, ascending
        over its real part); entries where `real` [B, K] is False become holes. Every dropped valid
        entry counts as evicted for its row, so `evicted` becomes [B]."""
        index = torch.as_tensor(index, dtype=torch.long)
        real = torch.ones_like(index, dtype=torch.bool) if real is None else real.to(torch.bool)
        before = self.valid.sum(1) if self.valid is not None else torch.full((index.shape[0],), self.length)
        kept = real & (self.valid.gather(1, index) if self.valid is not None else True)
        self.evicted = self.evicted + before - kept.sum(1)
        for layer in self._layers():
            for name in ("keys", "values"):
                buf = getattr(layer, name)
                gather = index.to(buf.device)[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[-1])
                setattr(layer, name, buf.gather(2, gather))
        self.valid = _or_none(kept)

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
