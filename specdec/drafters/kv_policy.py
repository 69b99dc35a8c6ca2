"""Lossy KV policies: what a self-drafter keeps of the target's exact K/V, parsed from spec strings.

Owns the policies of the `self_draft` drafter's cache and their spec strings:

    full                          every entry, exact (the default)
    window(sink=S,recent=R)       StreamingLLM: the first S and the last R stored entries
    snapkv(budget=B,window=W)     at the prefill, the B prompt positions the last W prompt queries attend to most
                                  (the last W included); everything generated is kept
    quant(bits=2|4|8,group=G)     every entry fake-quantized per group of G along head_dim, stored dequantized
    quant(bits=B,keys=token|channel)  stored packed (`specdec.runtime.packed_cache`), keys per token or per channel
                                  (evicting whole groups of G tokens: up to G - 1 extra entries per boundary)
    window(...)+quant(...)        policies compose left to right with '+'

Every hook (`transform`, `after_prefill`, `after_commit`) is a function of the committed entries alone, so the cache
equals the policy applied to a fresh prefill (`apply_to_prefill`). Knows nothing about drafts, acceptance or the loop.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.runtime.cache import KVCache
from specdec.runtime.packed_cache import PackedFormat, PackedKVCache, fake_quantize  # noqa: F401 (re-exported)
from specdec.core.draft import KVLayers

if TYPE_CHECKING:
    from specdec.runtime.model import Target

DEFAULT_QUANT_GROUP = 32
"""Group size of `quant(...)` when none is given (the whole head_dim when it is not a multiple)."""


@dataclass(frozen=True)
class ModelFacts:
    """What a policy checks its parameters against: the width of one key/value head, the longest sequence."""

    head_dim: int
    context_length: int


class KVPolicy:
    """Base policy: keeps every entry as is (`full`). Subclasses override the hooks they need."""

    spec = "full"
    evicts = False
    """True when the policy drops stored entries (`KVCache.retain`): its cache cannot be a
    preallocated one (`specdec.runtime.static_cache`), which never evicts."""

    packed: PackedFormat | None = None
    """The packed storage its cache uses (None: a plain `KVCache`)."""

    def check(self, facts: ModelFacts) -> None:
        """Raise ValueError when this policy cannot run on a model with these facts."""

    def new_cache(self) -> KVCache:
        """An empty cache of the kind this policy keeps."""
        return KVCache() if self.packed is None else PackedKVCache(self.packed)

    def transform(self, layers: KVLayers) -> KVLayers:
        """Entries about to be appended, [B, kv_heads, n, head_dim] per layer -> what is stored."""
        return layers

    def after_prefill(self, cache: KVCache, queries: QueryProbe) -> None:
        """Called once after the prompt's entries (all but the root) are appended."""
        self.after_commit(cache)

    def after_commit(self, cache: KVCache) -> None:
        """Called after each step's committed entries are appended."""


QueryProbe = Callable[[KVCache, int], torch.Tensor]
"""(cache of the exact prompt entries, W) -> attention mass [S] each stored entry gets from the last W
prompt positions' queries, summed over layers, heads and queries (snapkv); `RowsProbe`: (cache, W, rows)
-> per listed row of a batched cache, the mass [n_b] of each of its real entries (`row_entries` order)."""
RowsProbe = Callable[[KVCache, int, list[int]], list[torch.Tensor]]


class Window(KVPolicy):
    """StreamingLLM: the first `sink` and the last `recent` stored entries."""

    evicts = True

    def __init__(self, sink: int = 4, recent: int = 256) -> None:
        if sink < 0 or recent < 1:
            raise ValueError(f"window(sink={sink},recent={recent}): need sink >= 0 and recent >= 1")
        self.sink, self.recent = sink, recent
        self.spec = f"window(sink={sink},recent={recent})"

    def check(self, facts: ModelFacts) -> None:
        if self.sink + self.recent > facts.context_length:
            raise ValueError(f"{self.spec}: sink + recent = {self.sink + self.recent} exceeds the context length "
                             f"{facts.context_length}; use sink + recent <= {facts.context_length} (or kv=full)")

    def after_commit(self, cache: KVCache) -> None:
        if by_rows(cache):
            entries = row_entries(cache)
            keep = self.sink + self.recent
            if max(e.numel() for e in entries) > keep:
                retain_per_row(cache, [e if e.numel() <= keep else torch.cat([e[: self.sink], e[-self.recent:]])
                                       for e in entries])
            return
        n = cache.length
        if n > self.sink + self.recent:
            # Example: sink 2, recent 3, 8 stored -> keep stored entries [0, 1, 5, 6, 7].
            cache.retain(torch.cat([torch.arange(self.sink), torch.arange(n - self.recent, n)]))


class SnapKV(KVPolicy):
    """The `budget` prompt positions with the most attention from the last `window` prompt queries
    (the window itself always kept), chosen once at the prefill; generated entries are all kept."""

    evicts = True

    def __init__(self, budget: int = 1024, window: int = 32) -> None:
        if window < 1 or budget < window:
            raise ValueError(f"snapkv(budget={budget},window={window}): need window >= 1 and budget >= window")
        self.budget, self.window = budget, window
        self.spec = f"snapkv(budget={budget},window={window})"

    def check(self, facts: ModelFacts) -> None:
        if self.budget > facts.context_length:
            raise ValueError(f"{self.spec}: budget {self.budget} exceeds the context length {facts.context_length}")

    def after_prefill(self, cache: KVCache, queries: QueryProbe) -> None:
        if by_rows(cache):
            self._select_rows(cache, queries)
            return
        n = cache.length
        if n <= self.budget:
            return
        mass = queries(cache, self.window)[: n - self.window]  # [n - W] attention to the prefix
        chosen = mass.topk(self.budget - self.window).indices.sort().values.cpu()
        cache.retain(torch.cat([chosen, torch.arange(n - self.window, n)]))

    def _select_rows(self, cache: KVCache, queries: RowsProbe) -> None:
        """`after_prefill` per row of a batch: each row over budget selects among its own entries."""
        entries = row_entries(cache)
        over = [b for b, e in enumerate(entries) if e.numel() > self.budget]
        if not over:
            return
        chosen = list(entries)
        for b, mass in zip(over, queries(cache, self.window, over)):
            n = entries[b].numel()
            top = mass[: n - self.window].topk(self.budget - self.window).indices.sort().values.cpu()
            chosen[b] = entries[b][torch.cat([top, torch.arange(n - self.window, n)])]
        retain_per_row(cache, chosen)


class Quant(KVPolicy):
    """Asymmetric round-to-nearest per `group`: fake-quantized along head_dim (no `keys`), or stored
    packed with keys per `token` or per `channel`."""

    BITS = (2, 4, 8)
    KEYS = ("token", "channel")

    def __init__(self, bits: int = 4, group: int | None = None, keys: str | None = None) -> None:
        if bits not in self.BITS:
            raise ValueError(f"quant(bits={bits}): bits must be one of {list(self.BITS)}")
        if group is not None and group < 1:
            raise ValueError(f"quant(group={group}): group must be a positive divisor of head_dim")
        if keys is not None and keys not in self.KEYS:
            raise ValueError(f"quant(keys={keys}): keys must be one of {list(self.KEYS)} (or absent: simulated)")
        self.bits, self.group, self.keys = bits, group, keys
        self.spec = self._spec()

    def _spec(self) -> str:
        return (f"quant(bits={self.bits}" + ("" if self.group is None else f",group={self.group}")
                + ("" if self.keys is None else f",keys={self.keys}") + ")")

    def check(self, facts: ModelFacts) -> None:
        if self.group is None:
            self.group = DEFAULT_QUANT_GROUP if facts.head_dim % DEFAULT_QUANT_GROUP == 0 else facts.head_dim
            self.spec = self._spec()
        if self.keys is not None:
            self.packed = PackedFormat(self.bits, self.group, self.keys)
        if facts.head_dim % self.group:
            divisors = [g for g in range(1, facts.head_dim + 1) if facts.head_dim % g == 0]
            raise ValueError(f"{self.spec}: group {self.group} does not divide head_dim {facts.head_dim}; "
                             f"use one of {divisors}")

    def transform(self, layers: KVLayers) -> KVLayers:
        if self.keys is not None:  # the packed cache quantizes what it stores
            return layers
        return [(fake_quantize(k, self.bits, self.group), fake_quantize(v, self.bits, self.group)) for k, v in layers]


class Compose(KVPolicy):
    """Policies applied left to right (e.g. a window of quantized entries)."""

    def __init__(self, parts: list[KVPolicy]) -> None:
        self.parts = parts
        self.spec = "+".join(p.spec for p in parts)
        self.evicts = any(p.evicts for p in parts)

    def check(self, facts: ModelFacts) -> None:
        for p in self.parts:
            p.check(facts)
        self.spec = "+".join(p.spec for p in self.parts)
        formats = [p.packed for p in self.parts if p.packed is not None]
        if len(formats) > 1:
            raise ValueError(f"{self.spec}: a cache is packed once; use one quant(...,keys=...) term")
        self.packed = formats[0] if formats else None

    def transform(self, layers: KVLayers) -> KVLayers:
        for p in self.parts:
            layers = p.transform(layers)
        return layers

    def after_prefill(self, cache: KVCache, queries: QueryProbe) -> None:
        for p in self.parts:
            p.after_prefill(cache, queries)

    def after_commit(self, cache: KVCache) -> None:
        for p in self.parts:
            p.after_commit(cache)


def by_rows(cache: KVCache) -> bool:
    """True when `cache` needs the per-row hooks: several rows, holes, or per-row evictions."""
    return cache.batch > 1 or cache.valid is not None or not isinstance(cache.evicted, int)


def row_entries(cache: KVCache) -> list[torch.Tensor]:
    """Per row, the stored indices of its real entries (ascending): what the row alone would store."""
    if cache.valid is None:
        return [torch.arange(cache.length) for _ in range(cache.batch)]
    return [row.nonzero().flatten() for row in cache.valid]


def retain_per_row(cache: KVCache, chosen: list[torch.Tensor]) -> None:
    """Row b keeps the stored entries chosen[b] (ascending), the rest evicted for that row.
    Example: chosen [[0, 1, 5], [2]] -> index [[0, 1, 5], [2, 0, 0]], real [[T, T, T], [T, F, F]]."""
    width = max(c.numel() for c in chosen)
    index = torch.zeros(len(chosen), width, dtype=torch.long)  # [B, K]
    real = torch.zeros(len(chosen), width, dtype=torch.bool)  # [B, K]
    for b, c in enumerate(chosen):
        index[b, : c.numel()], real[b, : c.numel()] = c, True
    cache.retain_rows(index, real)


_POLICIES: dict[str, tuple[type[KVPolicy], tuple[str, ...]]] = {
    "full": (KVPolicy, ()),
    "window": (Window, ("sink", "recent")),
    "snapkv": (SnapKV, ("budget", "window")),
    "quant": (Quant, ("bits", "group", "keys")),
}
_TERM = re.compile(r"^\s*([a-z_]+)\s*(?:\((.*)\))?\s*$")
EXAMPLES = "full, window(sink=4,recent=256), snapkv(budget=1024,window=32), quant(bits=4,group=32), " \
           "quant(bits=4,keys=channel), window(sink=4,recent=256)+quant(bits=8)"


def parse_kv_policy(spec: str | KVPolicy) -> KVPolicy:
    """A policy from its spec string (see the module docstring); ValueError naming what would work."""
    if isinstance(spec, KVPolicy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a KV policy is a non-empty string, got {spec!r}; examples: {EXAMPLES}")
    parts = [_parse_term(term, spec) for term in spec.split("+")]
    return parts[0] if len(parts) == 1 else Compose(parts)


def _parse_term(term: str, spec: str) -> KVPolicy:
    m = _TERM.match(term.lower())
    if m is None or m[1] not in _POLICIES:
        raise ValueError(f"unknown KV policy {term.strip()!r} in {spec!r}; known: {', '.join(_POLICIES)} "
                         f"(examples: {EXAMPLES})")
    cls, params = _POLICIES[m[1]]
    kwargs = {}
    for item in filter(None, (m[2] or "").split(",")):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or key not in params or not (value.lstrip("-").isdigit() or key == "keys"):
            raise ValueError(f"malformed KV policy {term.strip()!r} in {spec!r}: {item.strip()!r} is not "
                             f"name=integer with name in {list(params) or 'nothing'} (e.g. {EXAMPLES})")
        kwargs[key] = value if key == "keys" else int(value)
    return cls(**kwargs)


def model_facts(target: Target) -> ModelFacts:
    """Head width and context length of `target`'s model."""
    cfg = target.model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelFacts(head_dim=int(head_dim), context_length=target.context_length)


def apply_to_prefill(policy: KVPolicy, layers: KVLayers, prompt_entries: int, queries: QueryProbe) -> KVCache:
    """The cache `policy` holds for committed entries `layers` ([B, kv_heads, S, head_dim] per layer,
    e.g. a fresh prefill) of which the first `prompt_entries` came with the prompt: the definition
    the incremental cache is tested against."""
    cache = policy.new_cache()
    cache.append(policy.transform([(k[..., :prompt_entries, :], v[..., :prompt_entries, :]) for k, v in layers]))
    policy.after_prefill(cache, queries)
    rest = [(k[..., prompt_entries:, :], v[..., prompt_entries:, :]) for k, v in layers]
    if rest and rest[0][0].shape[-2]:
        cache.append(policy.transform(rest))
        policy.after_commit(cache)
    return cache


def attention_probe(model: Target, prompt: list[int]) -> QueryProbe:
    """`attention_probe_rows` for a one-row cache whose prompt is `prompt`."""
    rows = attention_probe_rows(model, [prompt])
    return lambda cache, window: rows(cache, window, [0])[0]


def attention_probe_rows(model: Target, prompts: list[list[int]]) -> RowsProbe:
    """A `RowsProbe`, row b's prompt being `prompts[b]`: one forward runs the last W prompt tokens of every
    listed row over a front-packed copy of its real entries but the last W (the rest are holes), and scores
    each of its entries by the softmax attention of those queries, summed over layers, heads and queries,
    as if the row were alone. The queries are rebuilt from each attention layer's input (q_proj, optional
    q_norm, the model's own RoPE), since sdpa returns no weights."""

    def probe(cache: KVCache, window: int, rows: list[int]) -> list[torch.Tensor]:
        entries = [row_entries(cache)[b] for b in rows]
        counts = torch.tensor([e.numel() for e in entries])  # [R] real entries per listed row
        index = torch.zeros(len(rows), int(counts.max()), dtype=torch.long)  # [R, n_max]
        for r, e in enumerate(entries):
            index[r, : e.numel()] = e
        packed = []  # per layer (keys, values) [R, kv_heads, n_max, D], row r's real entries first
        for k, v in cache.tensors():
            gather = index.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
            packed.append((k[rows].gather(2, gather), v[rows].gather(2, gather)))
        evicted = cache.evicted[rows] if isinstance(cache.evicted, torch.Tensor) else \
            torch.full((len(rows),), cache.evicted)  # [R]
        scratch = KVCache()
        scratch.append(packed)
        scratch.valid = torch.arange(index.shape[1]) < (counts - window)[:, None]  # [R, n_max]
        scratch.evicted = evicted
        ends = (counts + evicted).tolist()  # each row's next position
        tokens = torch.tensor([prompts[b][end - window: end] for b, end in zip(rows, ends)])  # [R, W]
        captured = _queries(model, tokens, scratch)
        return [_mass([q[r:r + 1] for q in captured], [k[r:r + 1, :, :n] for k, _ in packed], n, window)
                for r, n in enumerate(counts.tolist())]

    return probe


def _queries(model: Target, tokens: torch.Tensor, cache: KVCache) -> list[torch.Tensor]:
    """Run `tokens` [B, W] through `model` over `cache`; the RoPE'd queries [B, heads, W, D] per layer."""
    captured: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_pre_hook(_capture_queries(captured), with_kwargs=True)
             for layer in model.model.model.layers]
    try:
        model.forward(tokens, cache)
    finally:
        for h in hooks:
            h.remove()
    return captured


def _mass(queries: list[torch.Tensor], keys: list[torch.Tensor], n: int, window: int) -> torch.Tensor:
    """[n] attention mass of n keys ([1, kv_heads, n, D] per layer) from the last W of them as
    queries ([1, heads, W, D] per layer, causal), summed over layers, heads and queries."""
    mass = torch.zeros(n, dtype=torch.float64)
    for q, k in zip(queries, keys):  # q [B, heads, W, D]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).to(q.dtype)  # [B, heads, n, D]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, heads, W, n]
        causal = torch.arange(n)[None] > torch.arange(n - window, n)[:, None]  # [W, n]
        scores = scores.masked_fill(causal.to(scores.device), float("-inf"))
        mass += scores.float().softmax(-1).sum((0, 1, 2)).double().cpu()
    return mass


def _capture_queries(out: list[torch.Tensor]):
    """Forward pre-hook on an attention module: append its RoPE'd queries [B, heads, n, D] to `out`."""

    def hook(attn, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, n, H]
        cos, sin = kwargs["position_embeddings"]
        q = attn.q_proj(hidden).view(*hidden.shape[:-1], -1, attn.head_dim)  # [B, n, heads, D]
        if getattr(attn, "q_norm", None) is not None:
            q = attn.q_norm(q)
        rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        out.append(rotate(q.transpose(1, 2), q.transpose(1, 2), cos, sin)[0])

    return hook
