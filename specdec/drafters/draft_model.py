"""Model-based drafting: `ModelDrafter`, a second causal LM (or a cheaper copy of the target) with its own KV cache,
grown with `grow_tree` one tree forward per level, keeping accepted nodes by id (`BlockSlots`); batches share one cache
with holes. `small` builds one from `model=`, or is the `self_draft` preset `layers=first(k)`.
"""

from __future__ import annotations

import torch

from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.common import BlockSlots
from specdec.drafters.registry import register
from specdec.drafters.lockstep import grow_rows
from specdec.drafters.self_draft import build_self_draft, score_rows
from specdec.runtime.forwards import drafter_cache, drafter_cache_kind
from specdec.runtime.model import Target
from specdec.core.grow import grow_tree


class ModelDrafter:
    """Drafts with `draft_model`, a Target sharing the target's vocabulary."""

    def __init__(self, draft_model: Target, *, target: Target, name: str, cache: str = "auto") -> None:
        if draft_model.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {draft_model.label!r} has vocabulary {draft_model.vocab_size}, target "
                f"{target.label!r} has {target.vocab_size}: a draft model must share the target's vocabulary"
            )
        self.name = name
        self.model = draft_model
        self.cache_kind = cache
        """Its own cache (`specdec.runtime.forwards.drafter_cache`): `auto` = the CUDA graph fast path on CUDA."""
        self.batchable = drafter_cache_kind(draft_model, cache) != "graphs"
        """Batches run on the dynamic or static cache (the CUDA-graph runner serves one row)."""
        self.reset()

    def reset(self) -> None:
        self.cache, self._forward = drafter_cache(self.model, self.cache_kind)
        self.consumed = 0  # committed tokens whose KV is in self.cache
        self.block = BlockSlots()
        self.row_consumed: list[int] = []  # batches: per row, committed tokens whose KV is in self.cache
        self.blocks: list[BlockSlots] = []  # batches: each row's block
        self.block_begin = 0  # batches: stored index of this step's first draft entry

    def _score(self, node_ids: list[int], tokens: torch.Tensor, parent_ids: list[int]) -> torch.Tensor:
        parents = self.block.add(node_ids, parent_ids)
        return self._forward(tokens, self.cache, parents).logits.float()  # [B, n, V]

    def propose(self, request: DraftRequest) -> Draft:
        pending = request.token_ids[:, self.consumed:]  # [B, n] always includes the root
        out = self._forward(pending, self.cache, logits_rows=slice(-1, None))
        self.consumed = request.token_ids.shape[1]
        self.block = BlockSlots()
        return grow_tree(request.shape, out.logits[:, -1].float(), self._score,
                         request.sampling, request.generator, request.max_depth)

    def commit(self, step: Step) -> None:
        if step.kept is not None:
            self._commit_rows(step)
            return
        if step.is_prefill:
            return
        kept = self.block.accepted(step)
        self.cache.keep(self.consumed, kept)
        self.consumed += len(kept)

    # ---- batches ------------------------------------------------------------------------------
    def propose_batch(self, request: DraftRequest) -> list[Draft]:
        rows, width = request.token_ids.shape
        lengths = request.lengths or [width] * rows
        if len(self.row_consumed) != rows:
            raise RuntimeError(f"{self.name}: holds {len(self.row_consumed)} batch rows, the request {rows}; every "
                               "Step must reach commit() and finished rows leave by select_rows()")
        # 1. Each row's unseen committed tokens (always its root) as one right-padded chain.
        #    Example: width 6, lengths [6, 3], consumed [4, 0] -> row 0 feeds its tokens 4, 5 and row 1
        #    its 3 tokens (columns 3..5 of the left-padded request): pending [[t4, t5, 0], [u0, u1, u2]].
        counts = [length - consumed for length, consumed in zip(lengths, self.row_consumed)]
        pending = torch.zeros(rows, max(counts), dtype=torch.long)  # [B, P]
        for b, count in enumerate(counts):
            pending[b, :count] = request.token_ids[b, width - count:].cpu()
        valid = torch.arange(pending.shape[1]) < torch.tensor(counts)[:, None]  # [B, P]
        out = self.model.forward(pending, self.cache, valid=None if bool(valid.all()) else valid)
        root = out.logits[torch.arange(rows), torch.tensor(counts) - 1].float()  # [B, V] after each root
        self.row_consumed = list(lengths)
        self.block_begin = self.cache.length
        self.blocks = [BlockSlots() for _ in range(rows)]
        # 2. Every row grows its own draft; each depth is one tree forward for all rows.
        asked = [request.row(b) for b in range(rows)]  # each row's own generator and depth limit
        if request.max_depth < 1:
            return [Draft.empty(device=request.token_ids.device) for _ in range(rows)]
        return grow_rows(request.shape, [root[b:b + 1] for b in range(rows)],
                         score_rows(self.model, self.cache, self.blocks), request.sampling,
                         [r.generator for r in asked], [r.max_depth for r in asked])

    def _commit_rows(self, step: Step) -> None:
        """`commit` for a batch: each row keeps the run nodes of its accepted path (`keep_rows`)."""
        if step.is_prefill:
            self.row_consumed = [0] * step.batch
            return
        if not self.blocks:  # no draft this step: the new tokens are fed with the next request
            return
        kept = [block.accepted(step.row(b)) for b, block in enumerate(self.blocks)]
        self.cache.keep_rows(self.block_begin, kept)
        self.row_consumed = [c + len(k) for c, k in zip(self.row_consumed, kept)]
        self.blocks = []

    def select_rows(self, rows: list[int]) -> None:
        self.cache.select_rows(rows)
        self.row_consumed = [self.row_consumed[b] for b in rows]


@register("small")
def build_small(*, target: Target, model: str | Target | None = None, layers: int | None = None,
                cache: str = "auto", **load_options):
    """A small draft model (`model=`), or by default an early-exit self-draft of the target's first `layers`
    layers (a quarter); `cache` is the draft model's own cache kind."""
    if model is None:
        total = target.model.config.num_hidden_layers
        return build_self_draft(target=target, layers=f"first({layers or max(1, total // 4)})", name="small",
                                cache=cache)
    if isinstance(model, Target):
        draft_model = model
    else:
        from specdec.loading import load_target

        draft_model = load_target(model, device=target.device, **load_options)
    return ModelDrafter(draft_model, target=target, name="small", cache=cache)
