"""Synthetic drafters of the certificate's reference cases.

Owns `SiblingDrafter` (sampled siblings that carry draft probabilities, or point-mass siblings) and
`ShiftedDrafter` (sampled chains from large logits through the real grower).
Knows nothing about cases, statistics or mutants.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.basic import RandomDrafter
from specdec.loop.reference import next_token_logits
from specdec.runtime.model import Target


class SiblingDrafter:
    """Synthetic drafter: every node gets `width` sampled siblings up to `depth` with their draft probabilities,
    i.i.d. (`replace=True`) or without replacement (each sibling's recorded distribution conditional on the earlier
    ones); or, with `point_mass=True`, its top-`width` tokens without draft probabilities (`shuffle=True`: in an
    order fixed per context). Its distribution after a context is softmax(sharpen x `like`'s logits + noise x
    N(0, 1)), the noise seeded by the context; without `like`, pure noise."""

    name = "siblings"

    def __init__(self, vocab_size: int, *, width: int = 2, depth: int = 2, replace: bool = False,
                 like: Target | None = None, sharpen: float = 1.0, noise: float = 1.0, seed: int = 0,
                 point_mass: bool = False, shuffle: bool = False) -> None:
        self.vocab_size, self.width, self.depth, self.replace = vocab_size, width, depth, replace
        self.point_mass, self.shuffle = point_mass, shuffle
        self.like, self.sharpen, self.noise, self.seed = like, sharpen, noise, seed

    def reset(self) -> None:
        pass

    def distribution(self, context: Sequence[int]) -> torch.Tensor:
        """[V] float64 draft distribution after `context` (deterministic in the context)."""
        g = torch.Generator().manual_seed(hash((self.seed, *context)) % (2**63))
        logits = self.noise * torch.randn(self.vocab_size, generator=g, dtype=torch.float64)
        if self.like is not None:
            logits = logits + self.sharpen * next_token_logits(self.like, context).double()
        return logits.softmax(-1)

    def propose(self, request: DraftRequest) -> Draft:
        committed = request.token_ids[0].tolist()
        tokens, parents, probs = [], [], []  # probs: [V] per node
        frontier = [(-1, committed)]
        for _ in range(min(self.depth, request.max_depth)):
            level = []
            for parent, context in frontier:
                q = self.distribution(context)
                if self.point_mass:
                    top = q.topk(min(self.width, self.vocab_size)).indices
                    if self.shuffle:  # the likeliest token at any sibling rank, fixed per context
                        top = top[torch.randperm(len(top), generator=torch.Generator().manual_seed(sum(context)))]
                    for x in top.tolist():
                        tokens.append(x)
                        parents.append(parent)
                        level.append((len(tokens) - 1, [*context, x]))
                    continue
                for _ in range(self.width):
                    if q.sum() <= 0:
                        break
                    q = q / q.sum()
                    x = int(torch.multinomial(q, 1, generator=request.generator))
                    tokens.append(x)
                    parents.append(parent)
                    probs.append(q)
                    level.append((len(tokens) - 1, [*context, x]))
                    if not self.replace:
                        q = q.clone()
                        q[x] = 0.0
            frontier = level
        if not tokens:
            return Draft.empty()
        draft_probs = None if self.point_mass else torch.stack(probs)[None]  # [B, N, V]
        return Draft(torch.tensor([tokens]), torch.tensor(parents), draft_probs)

    def commit(self, step: Step) -> None:
        pass


class ShiftedDrafter(RandomDrafter):
    """The `random` drafter with logits `offset` + `scale` x N(0, 1), grown by the real grower: fp32
    logits far from 0, where rounding them to bf16 (spacing 2 in [256, 512)) moves the law."""

    name = "shifted"

    def __init__(self, *, target: Target, offset: float = 300.0, scale: float = 3.0) -> None:
        super().__init__(target=target)
        self.offset, self.scale = offset, scale

    def _logits(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.offset + self.scale * super()._logits(n, generator)  # [B, n, V]
