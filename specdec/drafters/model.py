"""Model-based drafting: a second causal LM (or a cheaper copy of the target) drafts in any shape.

Owns `ModelDrafter`, which runs a draft `Target` with its own KV cache: before each draft it feeds
the committed tokens it has not seen yet, then grows the requested shape with `grow_tree`, scoring
each expanded level in one tree forward. Its rollback keeps, in its own cache, exactly the draft
nodes on the accepted path that it had run (the rest of the path is fed with the next request).

`small` builds one from `model=` (a built-in name, path, hub id or a loaded `Target`); without
one it uses the target's first `layers` decoder layers with the target's own final norm and lm_head
(weights shared, no training: an early-exit self-draft).
"""

from __future__ import annotations

import copy

import torch

from specdec.cache import KVCache
from specdec.drafters.base import Acceptance, Draft, DraftRequest, register
from specdec.models import Target
from specdec.shapes import grow_tree


class ModelDrafter:
    """Drafts with `draft_model`, a Target sharing the target's vocabulary."""

    needs_target_hidden = False

    def __init__(self, draft_model: Target, *, target: Target, name: str) -> None:
        if draft_model.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model {draft_model.name!r} has vocabulary {draft_model.vocab_size}, target "
                f"{target.name!r} has {target.vocab_size}: a draft model must share the target's vocabulary"
            )
        self.name = name
        self.model = draft_model
        self.cache = KVCache()
        self.consumed = 0  # committed tokens whose KV is in self.cache
        self.block_tokens: list[int] = []  # draft nodes run this step, in cache order after `consumed`
        self.block_parents: list[int] = []  # their parents as block indices (-1 = root)

    def reset(self) -> None:
        self.cache = KVCache()
        self.consumed = 0

    def _score(self, node_ids: list[int], tokens: torch.Tensor, parent_ids: list[int]) -> torch.Tensor:
        parent_slot = [self.slot[p] if p >= 0 else -1 for p in parent_ids]
        for node, tok, p in zip(node_ids, tokens[0].tolist(), parent_slot):
            self.slot[node] = len(self.block_tokens)
            self.block_tokens.append(tok)
            self.block_parents.append(p)
        out = self.model.forward(tokens, self.cache, torch.tensor(self.block_parents))
        return out.logits.float()  # [B, n, V]

    def propose(self, request: DraftRequest) -> Draft:
        ids = request.token_ids[0].tolist()
        pending = ids[self.consumed:]  # always includes the root
        out = self.model.forward(torch.tensor([pending]), self.cache, logits_rows=slice(-1, None))
        self.consumed = len(ids)
        self.block_tokens, self.block_parents, self.slot = [], [], {}
        return grow_tree(request.shape, out.logits[:, -1].float(), self._score,
                         request.sampling, request.generator, request.max_depth)

    def rollback(self, draft: Draft, acceptance: Acceptance) -> None:
        kept = accepted_block_slots(draft, acceptance, self.block_tokens, self.block_parents)
        self.cache.keep(self.consumed, kept)
        self.consumed += len(kept)


def accepted_block_slots(draft: Draft, acceptance: Acceptance, block_tokens: list[int],
                         block_parents: list[int]) -> list[int]:
    """Cache-block slots of the accepted path's nodes that a drafter ran, root's child first.

    The accepted tokens are walked through the block (token + parent slot), since the draft may
    have been re-indexed after growing; the walk stops at the first accepted node never run (a
    leaf). Example: block tokens [7, 9, 4] with parents [-1, -1, 1] and accepted tokens [9, 4, 5]
    -> slots [1, 2] (token 5 was a leaf, never run).
    """
    kept: list[int] = []
    parent = -1
    for tok in (int(draft.tokens[0, i]) for i in acceptance.path):
        slot = next((s for s, (t, p) in enumerate(zip(block_tokens, block_parents)) if t == tok and p == parent), None)
        if slot is None:
            break
        kept.append(slot)
        parent = slot
    return kept


def early_exit_copy(target: Target, layers: int) -> Target:
    """A Target that runs the target's first `layers` decoder layers, then its final norm and
    lm_head. Shares every weight with the target."""
    total = target.model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise ValueError(f"early-exit draft needs 1 <= layers <= {total}, got {layers}")
    shallow = copy.copy(target.model)  # shallow: modules are shared, only containers differ
    shallow._modules = dict(target.model._modules)  # copy.copy shares the submodule dict: unshare it,
    shallow.model = copy.copy(target.model.model)  # or the assignments below would truncate the target
    shallow.model._modules = dict(target.model.model._modules)
    shallow.model.layers = target.model.model.layers[:layers]
    shallow.config = copy.copy(target.model.config)
    shallow.config.num_hidden_layers = layers
    shallow.model.config = shallow.config
    return Target(shallow, target.tokenizer, name=f"{target.name}[:{layers} layers]")


@register("small")
def build_small(*, target: Target, model: str | Target | None = None, layers: int | None = None,
                **load_options) -> ModelDrafter:
    """A small draft model (`model=`), or by default an early-exit copy of the target."""
    if isinstance(model, Target):
        draft_model = model
    elif model is not None:
        from specdec.loading import load_target

        draft_model = load_target(model, device=target.device, **load_options)
    else:
        total = target.model.config.num_hidden_layers
        draft_model = early_exit_copy(target, layers or max(1, total // 4))
    return ModelDrafter(draft_model, target=target, name="small")
