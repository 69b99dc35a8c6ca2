"""A KV cache that stores its committed entries packed: int8 / int4 / int2 with per-group fp16 scales.

Owns `PackedKVCache` (a `KVCache` whose committed prefix is held packed and dequantized on the fly in front of the
full-precision tail), the two key layouts, and `held_bytes` (the bytes a cache's tensors actually hold).
Values are quantized per token in groups of G along head_dim; keys=token: likewise; keys=channel (KIVI): per
channel in groups of G consecutive tokens, committed entries waiting in full precision until G fill a group.
Only `append` packs, so the cache is a function of the committed entries alone. Eviction (`retain`) drops single
entries under keys=token; under keys=channel it keeps or drops whole groups (the G positions jG..jG+G-1, packed
together or pending): a group stays when any of its entries is retained, so a window holds up to G - 1 extra
entries per boundary, counted by `held_bytes` from the tensors held. Groups stay aligned to absolute positions,
so a policy whose retained set depends on the committed entries alone (a window, snapkv) keeps that property.
One row only (a batch raises). Knows nothing about drafts or policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from specdec.core.draft import KVLayers
from specdec.runtime.cache import KVCache


@dataclass(frozen=True)
class PackedFormat:
    """How a `PackedKVCache` stores its entries."""

    bits: int
    """Bits per stored value: 2, 4 or 8 (packed 4, 2 or 1 to a byte)."""
    group: int
    """Values sharing one scale and zero point (along head_dim, or tokens for channel keys)."""
    keys: str
    """Key layout: `token` or `channel` (see the module docstring)."""


def _quantize(g: torch.Tensor, bits: int, dim: int, dtype: torch.dtype = torch.float16,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, zero, scale in `dtype`) of `g` rounded asymmetrically (min-max) over its axis `dim`."""
    lo = g.amin(dim, keepdim=True).to(dtype)
    scale = ((g.amax(dim, keepdim=True) - lo.to(g.dtype)) / (2**bits - 1)).clamp_min(1e-6).to(dtype)
    codes = ((g - lo.to(g.dtype)) / scale.to(g.dtype)).round().clamp(0, 2**bits - 1).to(torch.uint8)
    return codes, lo, scale


def fake_quantize(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """x [..., D] rounded to `bits` per group of `group` along D, dequantized (scales in x's dtype)."""
    codes, lo, scale = _quantize(x.unflatten(-1, (-1, group)), bits, -1, x.dtype)  # [..., D/G, G]
    return (codes.to(x.dtype) * scale + lo).flatten(-2)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D] uint8 < 2**bits -> [..., D * bits / 8] uint8, lowest bits first.
    Example (bits 4): codes [3, 10] -> byte 3 | 10 << 4 = 163."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8, device=codes.device) * bits
    return (codes.view(*codes.shape[:-1], -1, per) << shifts).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack`: [..., D * bits / 8] uint8 -> codes [..., D] uint8."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


class PackedLayer(DynamicLayer):
    """One layer: a packed prefix (`parts`, `count` entries) and the full-precision tail (`keys`,
    `values`, [1, kv_heads, n, head_dim]) the model's forwards append to."""

    def __init__(self, fmt: PackedFormat) -> None:
        super().__init__()
        self.fmt = fmt
        self.count = 0
        self.parts: dict[str, torch.Tensor] = {}  # name -> packed codes, zero or scale, stacked on tokens

    def get_seq_length(self) -> int:
        return self.count + (super().get_seq_length() if self.is_initialized else 0)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        if not self.count:
            return keys, values
        past_keys, past_values = self.dequantized(keys.dtype)
        return torch.cat([past_keys, keys], -2), torch.cat([past_values, values], -2)

    def _split(self, x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, int, tuple[int, ...]]:
        """x [1, H, n, D] -> (groups, reduced axis, shape of the codes)."""
        g = self.fmt.group
        if per_channel:  # groups of G tokens per channel: [1, H, n/G, G, D], reduced over G
            return x.unflatten(-2, (-1, g)), -2, x.shape
        return x.unflatten(-1, (-1, g)), -1, x.shape  # groups of G along head_dim: [1, H, n, D/G, G]

    def pack(self, n: int) -> None:
        """Move the tail's first `n` entries into the packed prefix."""
        if not n:
            return
        for name, x, per_channel in (("k", self.keys, self.fmt.keys == "channel"), ("v", self.values, False)):
            groups, dim, shape = self._split(x[..., :n, :], per_channel)
            codes, zero, scale = _quantize(groups, self.fmt.bits, dim)
            new = {name: _pack(codes.reshape(shape), self.fmt.bits), name + "z": zero, name + "s": scale}
            for key, t in new.items():
                self.parts[key] = torch.cat([self.parts[key], t], 2) if key in self.parts else t  # axis 2: tokens
        self.keys, self.values = self.keys[..., n:, :], self.values[..., n:, :]
        self.count += n

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed prefix, dequantized: (keys, values) [1, H, count, D]."""
        out = []
        for name, per_channel in (("k", self.fmt.keys == "channel"), ("v", False)):
            codes = _unpack(self.parts[name], self.fmt.bits)  # [1, H, count, D]
            groups, _, shape = self._split(codes, per_channel)
            zero, scale = self.parts[name + "z"].to(dtype), self.parts[name + "s"].to(dtype)
            out.append((groups.to(dtype) * scale + zero).reshape(shape))
        return out[0], out[1]

    def select_packed(self, index: torch.Tensor) -> None:
        """Keep the packed entries `index` (ascending; whole groups under keys=channel, else ValueError)."""
        group, per_channel = self.fmt.group, self.fmt.keys == "channel"
        starts = index[::group]  # channel keys: one zero and one scale per group of G packed entries
        whole = torch.equal(index, (starts[:, None] + torch.arange(group)).flatten()) and not (starts % group).any()
        if per_channel and not whole:
            raise ValueError(f"keys=channel keeps whole groups of {group} packed entries, got {index.tolist()}")
        self.parts = {key: t.index_select(2, (starts // group if per_channel and key in ("kz", "ks") else index)
                                          .to(t.device)) for key, t in self.parts.items()}
        self.count = index.numel()


class PackedKVCache(KVCache):
    """A `KVCache` (one row) whose committed entries are stored packed in `fmt`."""

    def __init__(self, fmt: PackedFormat) -> None:
        super().__init__()
        self.fmt = fmt
        self.hf.layer_class_to_replicate = lambda: PackedLayer(fmt)
        self.pending = 0  # committed entries in the tail, waiting for a whole group (keys=channel)

    @property
    def batch(self) -> int:
        return 1

    def _packed(self) -> int:
        layers = self._layers()
        return layers[0].count if layers else 0

    def append(self, layers: KVLayers) -> None:
        """Append committed entries and pack every whole group. The tail must hold no forward's entries
        (the owner truncated them)."""
        if layers and layers[0][0].shape[0] != 1:
            raise ValueError(f"a packed KV cache holds one row, got {layers[0][0].shape[0]}: run prompts one at a time")
        if self.length != self._packed() + self.pending:
            raise ValueError("append after a forward: truncate the forward's entries to the committed ones first")
        while len(self.hf.layers) < len(layers):
            self.hf.layers.append(PackedLayer(self.fmt))
        for layer, (k, v) in zip(self.hf.layers, layers):
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k[..., :0, :], v[..., :0, :]
            layer.keys, layer.values = torch.cat([layer.keys, k], -2), torch.cat([layer.values, v], -2)
        tail = self.pending + layers[0][0].shape[-2] if layers else self.pending
        n = tail - tail % self.fmt.group if self.fmt.keys == "channel" else tail
        for layer in self._layers():
            layer.pack(n)
        self.pending = tail - n

    def retain(self, index: torch.Tensor) -> None:
        """`KVCache.retain` of committed entries; under keys=channel of every entry whose group holds one of
        `index` (stored index i is in group i // G: whole groups are packed, the pending ones follow).
        Example (G 4, 10 stored): index [0, 7, 8, 9] keeps [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]; [0, 8, 9] keeps
        [0, 1, 2, 3, 8, 9]."""
        if self.fmt.keys == "channel":
            stored = torch.arange(self.length)
            index = stored[torch.isin(stored // self.fmt.group, torch.as_tensor(index) // self.fmt.group)]
        super().retain(index)

    def _truncate_stored(self, length: int) -> None:
        packed = self._packed()
        if length < packed:
            raise ValueError(f"cannot truncate to {length} entries: the first {packed} are packed (committed)")
        super()._truncate_stored(length - packed)
        self.pending = min(self.pending, length - packed)

    def _select(self, index: torch.Tensor) -> None:
        packed = self._packed()
        head, tail = index[index < packed], index[index >= packed] - packed
        if not torch.equal(head, torch.arange(packed)):
            for layer in self._layers():
                layer.select_packed(head)
        self.pending = int((tail < self.pending).sum())
        super()._select(tail)

    def tensors(self) -> KVLayers:
        out = []
        for layer in self._layers():
            if not layer.count:
                out.append((layer.keys, layer.values))
                continue
            k, v = layer.dequantized(layer.keys.dtype)
            out.append((torch.cat([k, layer.keys], -2), torch.cat([v, layer.values], -2)))
        return out


def held_bytes(cache: KVCache) -> int:
    """Bytes of the K/V tensors `cache` holds (packed codes, scales and full-precision entries)."""
    total = 0
    for layer in cache._layers():
        total += layer.keys.nbytes + layer.values.nbytes
        total += sum(t.nbytes for t in getattr(layer, "parts", {}).values())
    return total
