"""Model-based drafting: a second causal LM (or a cheaper copy of the target) drafts in any shape.

Owns `ModelDrafter`, which runs a draft `Target` with its own KV cache: before each draft it feeds
the committed tokens it has not seen yet, then grows the requested shape with `grow_tree`, scoring
each expanded level in one tree forward. On `commit` it keeps, in its own cache, exactly the draft
nodes on the accepted path that it had run, found by node id (`BlockSlots`); the rest of the path
is fed with the next request.

`small` builds one from `model=` (a built-in name, path, hub id or a loaded `Target`); without
one it is the `self_draft` preset `layers=first(k)`: the target's first k decoder layers with the
target's own final norm and lm_head (weights shared, no training: an early-exit self-draft).
"""

from __future__ import annotations

import torch

from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.common import BlockSlots
from specdec.drafters.registry import register
from specdec.drafters.self_draft import build_self_draft
from specdec.target.forwards import drafter_cache
from specdec.target.model import Target
from specdec.core.shapes import grow_tree


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
        """Its own cache (`specdec.target.forwards.drafter_cache`): `auto` = the CUDA graph fast path on CUDA."""
        self.reset()

    def reset(self) -> None:
        self.cache, self._forward = drafter_cache(self.model, self.cache_kind)
        self.consumed = 0  # committed tokens whose KV is in self.cache
        self.block = BlockSlots()

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
        if step.is_prefill:
            return
        kept = self.block.accepted(step)
        self.cache.keep(self.consumed, kept)
        self.consumed += len(kept)


@register("small")
def build_small(*, target: Target, model: str | Target | None = None, layers: int | None = None,
                cache: str = "auto", **load_options):
    """A small draft model (`model=`, a `ModelDrafter`), or by default an early-exit self-draft of
    the target's first `layers` layers (default a quarter of them); `cache` is the draft model's
    own cache kind (`specdec.target.forwards.drafter_cache`)."""
    if model is None:
        total = target.model.config.num_hidden_layers
        return build_self_draft(target=target, layers=f"first({layers or max(1, total // 4)})", name="small",
                                cache=cache)
    if isinstance(model, Target):
        draft_model = model
    else:
        from specdec.target.loading import load_target

        draft_model = load_target(model, device=target.device, **load_options)
    return ModelDrafter(draft_model, target=target, name="small", cache=cache)
