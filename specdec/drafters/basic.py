"""The two trivial drafters: `none` (plain decoding through the same loop: the baseline of every speedup) and `random`
(random logits grown into the shape: exactness does not depend on the draft's quality).
"""

from __future__ import annotations

import torch

from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.common import PerRow
from specdec.drafters.registry import register
from specdec.core.grow import grow_tree


@register("none")
class NoDrafter:
    """Proposes an empty draft: the loop becomes plain autoregressive decoding."""

    name = "none"
    batchable = True

    def __init__(self, *, target) -> None:
        self.target = target

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Draft:
        return Draft.empty(device=request.token_ids.device)

    def commit(self, step: Step) -> None:
        pass

    def propose_batch(self, request: DraftRequest) -> list[Draft]:
        return [Draft.empty(device=request.token_ids.device) for _ in range(request.batch)]

    def select_rows(self, rows: list[int]) -> None:
        pass


@register("random")
class RandomDrafter(PerRow):
    """Drafts from i.i.d. standard-normal logits, in any shape, from the request's (in a batch, the row's own)
    random stream; stateless, so its row copies are plain copies (`PerRow`)."""

    name = "random"

    def __init__(self, *, target) -> None:
        self.vocab_size = target.vocab_size

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Draft:
        if request.max_depth < 1:  # a row asked for nothing draws nothing, as its run alone is not asked
            return Draft.empty(device=request.token_ids.device)
        generator = request.generator
        return grow_tree(request.shape, self._logits(1, generator)[:, 0],
                         lambda node_ids, tokens, parents: self._logits(len(node_ids), generator),
                         request.sampling, generator, request.max_depth)

    def _logits(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """[1, n, V] draft logits, drawn from `generator`."""
        return torch.randn(1, n, self.vocab_size, generator=generator, device=generator.device)

    def commit_one(self, step: Step) -> None:
        pass
