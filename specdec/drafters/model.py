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

import copy

import torch

from specdec.draft import Draft, Step
from specdec.drafters.base import DraftRequest, register
from specdec.forwards import drafter_cache
from specdec.models import Target
from specdec.shapes import grow_tree


class BlockSlots:
    """Where a drafter's cache holds the draft nodes it ran this step: node id -> block slot.

    The *block* is the run of cache entries a drafter appended while growing a draft, after its
    committed prefix; `parents` records each entry's parent slot (-1 = the root), which is what a
    tree forward of the next level needs. `accepted(step)` turns the accepted path into the slots to
    keep, by a gather on node ids. Example: nodes 0, 1, 5 ran into slots 0, 1, 2 and the accepted
    path has node ids [1, 5, 7] -> slots [1, 2] (node 7 was a leaf, never run).
    """

    def __init__(self) -> None:
        self.parents: list[int] = []  # parent slot per block entry, -1 = the root
        self.slot: dict[int, int] = {}  # node id -> block slot

    def add(self, node_ids: list[int], parent_ids: list[int]) -> torch.Tensor:
        """Record nodes about to be run; returns the block's parents [M] for the tree forward."""
        for node, parent in zip(node_ids, parent_ids):
            self.slot[node] = len(self.parents)
            self.parents.append(self.slot[parent] if parent >= 0 else -1)
        return torch.tensor(self.parents, dtype=torch.long)

    def accepted(self, step: Step) -> list[int]:
        """Block slots of the accepted path's nodes that were run, root's child first."""
        kept = []
        for node in step.accepted_node_ids().tolist():
            if node not in self.slot:  # a node that was never run has no run descendants either
                break
            kept.append(self.slot[node])
        return kept


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
        """Its own cache (`specdec.forwards.drafter_cache`): `auto` = the CUDA graph fast path on CUDA."""
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
    return Target(shallow, target.tokenizer, name=f"{target.name}[:{layers} layers]", quant=target.quant,
                  kernel=target.kernel, info=target.info)


@register("small")
def build_small(*, target: Target, model: str | Target | None = None, layers: int | None = None,
                cache: str = "auto", **load_options):
    """A small draft model (`model=`, a `ModelDrafter`), or by default an early-exit self-draft of
    the target's first `layers` layers (default a quarter of them); `cache` is the draft model's
    own cache kind (`specdec.forwards.drafter_cache`)."""
    if model is None:
        from specdec.drafters.self_draft import build_self_draft

        total = target.model.config.num_hidden_layers
        return build_self_draft(target=target, layers=f"first({layers or max(1, total // 4)})", name="small",
                                cache=cache)
    if isinstance(model, Target):
        draft_model = model
    else:
        from specdec.loading import load_target

        draft_model = load_target(model, device=target.device, **load_options)
    return ModelDrafter(draft_model, target=target, name="small", cache=cache)
