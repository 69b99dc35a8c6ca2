"""`ngram`: prompt-lookup drafting from the committed tokens themselves: the trailing n-gram (`max_ngram` down to
`min_ngram`) looked up earlier, a chain taking the best continuation, trees merging several into a trie. `Draft.scores`
weigh nodes by their matches, with a prior from a running hit rate (its only state) for `auto` to calibrate.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.common import PerRow
from specdec.drafters.registry import register
from specdec.core.shapes import Shape


def _limits(shape: Shape, max_depth: int) -> tuple[int, list[int], int]:
    """(depth, children allowed per node at each depth, node budget) for a shape."""
    return min(shape.depth, max_depth), list(shape.widths), shape.max_nodes


@register("ngram")
class NgramDrafter(PerRow):
    """Prompt-lookup drafter (point-mass drafts in any shape); batches row by row (`PerRow`)."""

    name = "ngram"

    def __init__(self, *, target=None, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self.reset()

    HIT_WEIGHT = 0.2
    """EMA weight of the hit rate (did the committed token after the root equal the best candidate's
    first token), which sets the prior mass of the confidences."""

    def reset(self) -> None:
        self.hit_rate = 0.5
        self._guess: tuple[int, int] | None = None  # (root position + 1, the best candidate's first token)

    def candidates(self, ids: np.ndarray, depth: int) -> dict[tuple[int, ...], int]:
        """Continuations of the trailing n-gram's earlier occurrences, best first (longest n-gram,
        then most recent match), each with its weight: the sum of the n of the matches that gave it."""
        out: dict[tuple[int, ...], int] = {}
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ids) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # starts 0..L-1-n
            starts = np.flatnonzero((windows == ids[-n:]).all(1))[::-1]  # most recent first
            for s in starts[: self.max_matches]:
                cont = tuple(ids[s + n : s + n + depth].tolist())
                if cont:
                    out[cont] = out.get(cont, 0) + n
        return out

    def propose(self, request: DraftRequest) -> Draft:
        depth, widths, budget = _limits(request.shape, request.max_depth)
        ids = request.token_ids[0].cpu().numpy()
        tokens: list[int] = []
        parents: list[int] = []
        kids: dict[int, dict[int, int]] = {-1: {}}  # node -> {token: child node}
        node_depth = {-1: 0}
        found = self.candidates(ids, depth)
        self._guess = (len(ids), next(iter(found))[0]) if found else None
        weight = {-1: sum(found.values())}  # the candidates' weight through each node
        for cont, w in found.items():
            node = -1
            for tok in cont:
                if tok in kids[node]:
                    node = kids[node][tok]
                    weight[node] += w
                    continue
                if len(tokens) >= budget or len(kids[node]) >= widths[node_depth[node]]:
                    break
                tokens.append(tok)
                parents.append(node)
                kids[node][tok] = len(tokens) - 1
                node = len(tokens) - 1
                kids[node], node_depth[node], weight[node] = {}, node_depth[parents[-1]] + 1, w
            if len(tokens) >= budget:
                break
        if not tokens:
            return Draft.empty(device=request.token_ids.device)
        # Scores: cumulative log of each node's confidence, its weight over its parent's weight plus a
        # prior mass for "the target continues otherwise" that shrinks as the recent hit rate grows.
        prior = min(10.0, max(0.1, (1.0 - self.hit_rate) / max(self.hit_rate, 1e-3)))
        scores: list[float] = []
        for i, parent in enumerate(parents):
            own = math.log(weight[i] / (weight[parent] + prior))
            scores.append(own + (scores[parent] if parent >= 0 else 0.0))
        return Draft(torch.tensor([tokens]), torch.tensor(parents, dtype=torch.long),
                     scores=torch.tensor(scores, dtype=torch.float32))

    def commit_one(self, step: Step) -> None:
        """Update the hit rate from this step's committed tokens (whatever part of the draft was verified)."""
        if step.is_prefill:
            self.reset()
        elif self._guess is not None:
            position, token = self._guess
            if step.token_ids.shape[1] > position:
                hit = float(int(step.token_ids[0, position]) == token)
                self.hit_rate += self.HIT_WEIGHT * (hit - self.hit_rate)
        self._guess = None
