"""Self-draft: the target's own weights (or a cheaper copy) over a lossy view of the target's own KV.

Owns the `self_draft` drafter and its spec-string knobs: `kv=` (a `kv_policy` spec), `weights=` (a `specdec.quant`
spec, `quantized_copy`) and `layers=` (`all` or `first(k)`, `early_exit_copy`); `lowbit` and `small` are presets.
Cache sync (`commit(step)`): the draft's cache holds the target's exact K/V (`step.target_kv()`) of committed tokens
only, through the policy; `commit` drops the draft's own entries, so cache == policy(fresh prefill). On the
CUDA-graph cache it drafts one prompt only (`batchable` False). Knows nothing about acceptance or the target's cache
beyond the read-only step view.
"""

from __future__ import annotations

import re

import torch

from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.registry import register
from specdec.drafters.common import BlockSlots, early_exit_copy
from specdec.drafters.lockstep import Ask, ScoreRows, grow_rows
from specdec.runtime.cache import Cache
from specdec.runtime.forwards import drafter_cache, drafter_cache_kind
from specdec.drafters.kv_policy import KVPolicy, attention_probe, attention_probe_rows, model_facts, parse_kv_policy
from specdec.runtime.model import Target
from specdec.core.grow import grow_tree


def parse_layers(spec: str | int, total: int) -> int:
    """Number of leading target layers the draft runs: `all` -> total, `first(k)` (or k) -> k."""
    text = str(spec).strip().lower()
    m = re.fullmatch(r"first\((-?\d+)\)|(-?\d+)", text)
    if text == "all":
        return total
    if m is None:
        raise ValueError(f"layers={spec!r} is not a layer set; use 'all' or 'first(k)' with 1 <= k <= {total}")
    k = int(m[1] or m[2])
    if not 1 <= k <= total:
        raise ValueError(f"layers={spec!r} selects {'no' if k < 1 else 'more than the'} layers: the target has "
                         f"{total}; use 'first(k)' with 1 <= k <= {total}, or 'all'")
    return k


def draft_model(target: Target, weights: str = "none", layers: str | int = "all") -> Target:
    """The model a self-drafter runs: `target`, cut to its first layers, then weight-quantized.
    Raises ValueError for a layer set out of range or a weights spec that cannot run here."""
    from specdec.quant import BackendUnavailableError, quantized_copy

    total = target.model.config.num_hidden_layers
    k = parse_layers(layers, total)
    model = target if k == total else early_exit_copy(target, k)
    if str(weights).strip().lower() == "none":
        return model
    try:
        return quantized_copy(model, weights)
    except BackendUnavailableError as err:
        raise ValueError(f"weights={weights!r} cannot run on {target.device}: {err}; use a spec that "
                         f"`specdec.quant.availability` accepts here, e.g. 'rtn8_pc' or 'bf16'") from err


class SelfDrafter:
    """Drafts with `model` (the target or a cheaper copy) over a cache kept by `policy`."""

    def __init__(self, model: Target, policy: KVPolicy, *, target: Target, name: str = "self_draft",
                 cache: str = "auto") -> None:
        policy.check(model_facts(target))
        self.name = name
        self.model = model
        self.policy = policy
        self.layers = model.model.config.num_hidden_layers
        self.cache_kind = cache
        """Its own cache (`specdec.runtime.forwards.drafter_cache`): `auto` = the CUDA graph fast path on CUDA
        unless the KV policy evicts."""
        self.batchable = drafter_cache_kind(model, cache, _own(policy)) != "graphs" and policy.packed is None
        """Batches run on the dynamic or static cache (the CUDA-graph runner and a packed cache serve one row)."""
        self.reset()

    def reset(self) -> None:
        self.cache, self._forward = drafter_cache(self.model, self.cache_kind, _own(self.policy))
        if self.policy.packed is not None:
            self.cache, self._forward = self.policy.new_cache(), self.model.forward
        self.committed = 0  # absolute position after the last committed entry
        self.block = BlockSlots()
        self.stored = 0  # batches: stored entries of committed tokens (the draft's block follows)
        self.blocks: list[BlockSlots] = []  # batches: each row's block

    def _exact(self, step: Step) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The target's K/V for the kept rows, first `self.layers` layers, copied in the draft's dtype."""
        dtype = self.model.base.get_input_embeddings().weight.dtype
        return [(k.to(dtype=dtype, copy=True), v.to(dtype=dtype, copy=True))
                for k, v in step.target_kv()[: self.layers]]

    def commit(self, step: Step) -> None:
        if step.kept is not None:
            self._commit_rows(step)
            return
        self.cache.truncate(self.committed)  # drop every draft entry, accepted ones included
        self.cache.append(self.policy.transform(self._exact(step)))
        if step.is_prefill:
            self.policy.after_prefill(self.cache, attention_probe(self.model, step.token_ids[0].tolist()))
        else:
            self.policy.after_commit(self.cache)
        self.committed = self.cache.next_position

    def _score(self, node_ids: list[int], tokens: torch.Tensor, parent_ids: list[int]) -> torch.Tensor:
        parents = self.block.add(node_ids, parent_ids)
        return _wide(self._forward(tokens, self.cache, parents).logits)  # [B, n, V]

    def propose(self, request: DraftRequest) -> Draft:
        if self.committed != request.token_ids.shape[1] - 1:
            raise RuntimeError(f"{self.name}: cache holds {self.committed} committed positions, the request "
                               f"{request.token_ids.shape[1] - 1}; call reset() and commit(prefill) first")
        if request.max_depth < 1:
            return Draft.empty()
        root = request.token_ids[:, -1:]  # [B, 1]
        out = self._forward(root, self.cache)
        self.block = BlockSlots()
        return grow_tree(request.shape, _wide(out.logits[:, -1]), self._score,
                         request.sampling, request.generator, request.max_depth)


    # ---- batches ------------------------------------------------------------------------------
    def _commit_rows(self, step: Step) -> None:
        """`commit` for a batch: drop every row's draft entries, append each row's first step.kept[b]
        target entries (the padding after them becomes holes), then the policy per row."""
        if self.cache.length > self.stored:
            self.cache.keep_rows(self.stored, [[] for _ in range(step.batch)])
        width = step.positions.shape[1]  # K: the widest row's kept entries
        if width:
            self.cache.append(self.policy.transform(self._exact(step)))
            self.cache.append_valid(torch.arange(width) < torch.tensor(step.kept)[:, None], width)  # [B, K]
        if step.is_prefill:
            prompts = [step.row(b).token_ids[0].tolist() for b in range(step.batch)]
            self.policy.after_prefill(self.cache, attention_probe_rows(self.model, prompts))
        else:
            self.policy.after_commit(self.cache)
        self.stored = self.cache.length

    def propose_batch(self, request: DraftRequest) -> list[Draft]:
        rows, width = request.token_ids.shape
        lengths = torch.tensor(request.lengths or [width] * rows)
        held = self.cache.next_positions.expand(rows) if self.cache.length == 0 else self.cache.next_positions
        if held.shape[0] != rows or not torch.equal(held, lengths - 1):
            raise RuntimeError(f"{self.name}: cache rows hold {held.tolist()} committed positions, the request "
                               f"{(lengths - 1).tolist()}; every Step must reach commit() and finished rows "
                               "leave by select_rows()")
        if request.max_depth < 1:
            return [Draft.empty(device=request.token_ids.device) for _ in range(rows)]
        root = _wide(self.model.forward(request.token_ids[:, -1:], self.cache).logits[:, -1])  # [B, V]
        self.blocks = [BlockSlots() for _ in range(rows)]
        asked = [request.row(b) for b in range(rows)]  # each row's own generator and depth limit
        return grow_rows(request.shape, [root[b:b + 1] for b in range(rows)],
                         score_rows(self.model, self.cache, self.blocks), request.sampling,
                         [r.generator for r in asked], [r.max_depth for r in asked])

    def select_rows(self, rows: list[int]) -> None:
        self.cache.select_rows(rows)
        self.stored = self.cache.length


def score_rows(model: Target, cache: Cache, blocks: list[BlockSlots]) -> ScoreRows:
    """The `grow_rows` scorer of a model drafter: each round's asks run as one tree forward of `model`
    over `cache`, row b's nodes recorded in `blocks[b]`. Rows asking fewer nodes (or none) are padded:
    padding tokens become holes and their block slots (parent -1) are never any node's.
    Example: row 0 asks nodes [3, 4] under [0, 0], row 1 nothing; both blocks held 3 slots ->
    tokens [[t3, t4], [0, 0]], valid [[T, T], [F, F]], parents [[-1, 0, 1, 0, 0], [-1, 0, 1, -1, -1]]."""

    def score(asks: dict[int, Ask]) -> dict[int, torch.Tensor]:
        n = max(tokens.shape[1] for _, tokens, _ in asks.values())
        tokens = torch.zeros(len(blocks), n, dtype=torch.long)  # [B, n]
        valid = torch.zeros(len(blocks), n, dtype=torch.bool)  # [B, n]
        for b, block in enumerate(blocks):
            count = 0
            if b in asks:
                node_ids, row_tokens, parent_ids = asks[b]
                block.add(node_ids, parent_ids)
                count = row_tokens.shape[1]
                tokens[b, :count], valid[b, :count] = row_tokens[0].cpu(), True
            block.parents.extend([-1] * (n - count))
        parents = torch.tensor([block.parents for block in blocks], dtype=torch.long)  # [B, M]
        logits = model.forward(tokens, cache, parents, valid=None if bool(valid.all()) else valid).logits
        return {b: _wide(logits[b:b + 1, : ask[1].shape[1]]) for b, ask in asks.items()}  # [1, n_b, V]

    return score


@register("self_draft")
def build_self_draft(*, target: Target, kv: str = "full", weights: str = "none", layers: str | int = "all",
                     name: str = "self_draft", cache: str = "auto") -> SelfDrafter:
    """A self-drafter: `kv` (KV policy spec), `weights` (quant spec), `layers` ('all' | 'first(k)'),
    `cache` (the draft's own cache kind, `specdec.runtime.forwards.drafter_cache`). Every option is checked
    here, before any generation."""
    policy = parse_kv_policy(kv)
    policy.check(model_facts(target))  # before the (possibly slow) quantized copy
    drafter_cache_kind(target, cache, _own(policy))  # a cache kind the policy cannot use fails here
    return SelfDrafter(draft_model(target, weights, layers), policy, target=target, name=name, cache=cache)


build_self_draft.test_options = {"kv": "window(sink=2,recent=5)+quant(bits=4)", "weights": "rtn8_pc",
                                 "layers": "first(1)"}


def _own(policy: KVPolicy) -> bool:
    """True when the policy's cache cannot be a preallocated one: it evicts, or it is packed."""
    return policy.evicts or policy.packed is not None


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32, or wider where the model computes wider (an fp64 world stays fp64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))
