"""The two trivial drafters: `none` (plain autoregressive decoding) and `random` (garbage drafts).

`none` proposes nothing, so the loop degenerates to one target forward per token with the same
cache and sampler as every speculative run: the baseline of every speedup. `random` proposes
uniformly random logits grown into the requested shape: a draft that is almost always wrong, used
to show that exactness does not depend on the draft's quality.
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
    """Drafts from i.i.d. standard-normal logits over the target vocabulary, in any shape. In a batch
    row b's copy draws its logits from its own stream, seeded `seed + b` (`PerRow`)."""

    name = "random"

    def __init__(self, *, target, seed: int = 1234) -> None:
        self.vocab_size = target.vocab_size
        self.seed = seed
        self.rng = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        self.rng.manual_seed(self.seed)

    def _logits(self, n: int) -> torch.Tensor:
        return torch.randn(1, n, self.vocab_size, generator=self.rng)  # [B, n, V]

    def propose(self, request: DraftRequest) -> Draft:
        return grow_tree(
            request.shape,
            self._logits(1)[:, 0],
            lambda node_ids, tokens, parents: self._logits(len(node_ids)),
            request.sampling,
            request.generator,
            request.max_depth,
        )

    def commit_one(self, step: Step) -> None:
        pass

    def row_copy(self, row: int) -> RandomDrafter:
        copy_ = RandomDrafter.__new__(RandomDrafter)
        copy_.vocab_size, copy_.seed, copy_.rows = self.vocab_size, self.seed + row, []
        copy_.rng = torch.Generator().manual_seed(copy_.seed)
        return copy_
