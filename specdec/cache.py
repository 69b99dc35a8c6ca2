"""The KV cache of one model, with the two rollbacks speculative decoding needs.

Owns: a Hugging Face `DynamicCache` (plain full-attention layers, one per decoder layer) and its
length, and the explicit rollbacks `truncate` (chain: keep a prefix) and `keep` (tree: keep a prefix
plus exactly the accepted nodes). The cache grows only when a forward appends the tokens it was
given; nothing else moves it. Knows nothing about drafts or acceptance.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVCache:
    """A growable KV cache with explicit rollback. Tensors per layer: [B, heads, S, head_dim]."""

    def __init__(self) -> None:
        self.hf = DynamicCache()

    @property
    def length(self) -> int:
        """Number of positions stored (S)."""
        return self.hf.get_seq_length()

    def _layers(self):
        return [layer for layer in self.hf.layers if getattr(layer, "is_initialized", False)]

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions (chain rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        for layer in self._layers():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

    def keep(self, start: int, offsets: list[int] | torch.Tensor) -> None:
        """Keep positions [0, start) and then start + offsets, in that order (tree rollback).

        Example: the verifier appended a root and 5 draft nodes at positions 10..15 and accepted the
        root plus nodes 1 and 4, i.e. entries 0, 2 and 5 of the block: keep(10, [0, 2, 5]) leaves
        positions 0..9, 10, 12, 15 -> a cache of length 13, equal to a prefill of those 13 tokens.
        """
        offsets = torch.as_tensor(offsets, dtype=torch.long)
        n = offsets.numel()
        if n and (int(offsets.min()) < 0 or start + int(offsets.max()) >= self.length):
            raise ValueError(f"keep offsets {offsets.tolist()} fall outside the cache block [{start}, {self.length})")
        if torch.equal(offsets, torch.arange(n)):
            self.truncate(start + n)
            return
        index = torch.cat([torch.arange(start), start + offsets])
        for layer in self._layers():
            idx = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)

    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, for tests and inspection."""
        return [(layer.keys, layer.values) for layer in self._layers()]
