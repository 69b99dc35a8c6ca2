"""Growing a draft in any concrete shape from a drafter's next-token logits.

Owns `grow_tree` (one row) and `SubVocab`: chain(k) takes the argmax (at T > 0 samples, recording `draft_probs`),
tree(w1, ...) each node's top-w_d children, dynamic(top_k, depth, budget) is EAGLE-2 (ranked by cumulative
log-probability, kept in `Draft.scores`). Knows nothing about which model produces the logits (a `score` callback).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.core.draft import Draft
from specdec.core.sampling import SamplingConfig, target_probs_from_logits
from specdec.core.shapes import ChainShape, DynamicShape, Shape, TreeShape

# score(node_ids, tokens, parent_ids) -> logits [B, n, V] of the token after each listed node.
# node_ids / parent_ids are indices into the draft being grown (-1 = the root); a scored node's
# parent has always been scored before (or is the root), so a drafter can keep them in its cache.
ScoreFn = Callable[[list[int], torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class SubVocab:
    """A drafter's reduced vocabulary: column j of its logits is target token `ids[j]`; growers rank and
    sample within the columns, never building a full-vocabulary tensor (but sampled `draft_probs`)."""

    ids: torch.Tensor  # [Vd] long target token ids, on the drafter's device
    size: int  # The full (target) vocabulary size V.

    def to_target(self, columns: torch.Tensor) -> torch.Tensor:
        return self.ids[columns]

    def expand(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V], zero outside the sub-vocabulary."""
        full = probs.new_zeros(*probs.shape[:-1], self.size)
        full[..., self.ids] = probs
        return full


def grow_tree(
    shape: Shape,
    root_logits: torch.Tensor,  # [B, Vd] drafter logits for the token after the root
    score: ScoreFn,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_depth: int,
    vocab: SubVocab | None = None,
) -> Draft:
    """Grow a draft in `shape` from a drafter's next-token logits (see the module docstring).

    `vocab` (None = whole vocabulary) maps logit columns to token ids; `score` returns logits over the
    same columns. Widths larger than the columns are clamped. Host syncs: none for chains and static
    trees beyond sampling's; one per expanded depth of a dynamic tree, and one for its final selection."""
    if root_logits.shape[0] != 1:
        raise NotImplementedError(f"grow_tree supports batch size 1 only, got {root_logits.shape[0]}")
    if max_depth < 1:
        return Draft.empty(device=root_logits.device)
    grower = _GROWERS[type(shape)]
    return grower(shape, root_logits, score, sampling, generator, max_depth, vocab)


def _ids(columns: torch.Tensor, vocab: SubVocab | None) -> torch.Tensor:
    """Target token ids of logit columns."""
    return columns if vocab is None else vocab.to_target(columns)


def _grow_chain(shape, root_logits, score, sampling, generator, max_depth, vocab) -> Draft:
    k = min(shape.k, max_depth)
    columns, probs, logits = [], [], root_logits  # logits [B, Vd]
    conf = []  # per depth [B, 1] the drafter's log-probability of the token it chose
    for depth in range(k):
        if sampling.greedy:
            column = logits.argmax(-1, keepdim=True)  # [B, 1]
        else:
            p = target_probs_from_logits(logits, sampling)  # [B, Vd]
            column = torch.multinomial(p, 1, generator=generator)
            probs.append(p)
        conf.append(logits.float().log_softmax(-1).gather(-1, column))
        columns.append(column)
        if depth + 1 < k:
            logits = score([depth], _ids(column, vocab), [depth - 1])[:, -1]
    draft_probs = None
    if probs:
        draft_probs = torch.stack(probs, 1)  # [B, k, Vd]
        draft_probs = draft_probs if vocab is None else vocab.expand(draft_probs)
    scores = torch.cat(conf, 1)[0].cumsum(0)  # [k] cumulative draft log-probability
    return Draft(_ids(torch.cat(columns, 1), vocab), torch.arange(k) - 1, draft_probs, scores=scores)


def _grow_static(shape, root_logits, score, sampling, generator, max_depth, vocab) -> Draft:
    widths = [min(w, root_logits.shape[-1]) for w in shape.widths[:max_depth]]
    tokens: list[torch.Tensor] = []  # per level [B, n_level] target ids
    parents: list[torch.Tensor] = []  # per level [n_level]
    scores: list[torch.Tensor] = []  # per level [n_level] cumulative draft log-probability
    frontier, frontier_logits = torch.tensor([-1]), root_logits[:, None]  # logits [B, n_frontier, Vd]
    frontier_scores = torch.zeros(1, device=root_logits.device)
    count = 0
    for depth, width in enumerate(widths):
        # Level order: frontier node f's children are nodes count + f * width + (0..width-1), best first.
        top = frontier_logits[0].topk(width, dim=-1).indices  # [n_frontier, width]
        top_lp = frontier_logits[0].float().log_softmax(-1).gather(-1, top)
        level_tokens = _ids(top.flatten(), vocab)[None]  # [B, n_frontier * width]
        level_parents = frontier.repeat_interleave(width)  # [n_frontier * width]
        level = torch.arange(count, count + level_parents.numel())
        frontier_scores = (frontier_scores[:, None] + top_lp).flatten()  # [n_frontier * width]
        tokens.append(level_tokens)
        parents.append(level_parents)
        scores.append(frontier_scores)
        count += level.numel()
        frontier = level
        if depth + 1 < len(widths):
            frontier_logits = score(level.tolist(), level_tokens, level_parents.tolist())
    return Draft(torch.cat(tokens, 1), torch.cat(parents), scores=torch.cat(scores))


def _grow_dynamic(shape, root_logits, score, sampling, generator, max_depth, vocab) -> Draft:
    depth_limit = min(shape.depth, max_depth)
    k = min(shape.top_k, root_logits.shape[-1])
    device = root_logits.device
    tokens: list[torch.Tensor] = []  # per level [n_level] target ids
    parents: list[torch.Tensor] = []  # per level [n_level] (CPU: parents of node ids are host-known)
    scores: list[torch.Tensor] = []  # per level [n_level] cumulative draft log-probability
    frontier, frontier_scores = torch.tensor([-1]), torch.zeros(1, device=device)
    logprobs = root_logits.float().log_softmax(-1)  # [n_frontier, Vd]
    count = 0
    for depth in range(depth_limit):
        # Children of each expanded node: its top_k next tokens. Level node f * k + j is frontier
        # node f's j-th best child.
        top_lp, top_col = logprobs.topk(k, dim=-1)  # [n_frontier, k]
        level_scores = (frontier_scores[:, None] + top_lp).flatten()  # [n_frontier * k]
        level_tokens = _ids(top_col.flatten(), vocab)  # [n_frontier * k]
        level_parents = frontier.repeat_interleave(k)
        tokens.append(level_tokens)
        parents.append(level_parents)
        scores.append(level_scores)
        if depth + 1 == depth_limit:
            break
        # Expand the top_k nodes of this level by cumulative score, in level order.
        best = level_scores.topk(min(k, level_scores.numel())).indices.sort().values  # [k'] on device
        best_host = best.cpu()  # the one host sync of this depth: node ids for the score callback
        frontier = count + best_host
        frontier_scores = level_scores[best]
        logits = score(frontier.tolist(), level_tokens[best][None], level_parents[best_host].tolist())
        logprobs = logits[0].float().log_softmax(-1)
        count += level_tokens.numel()
    # Re-rank: a child's score never exceeds its parent's and parents have lower indices, so the
    # best `budget` under (score desc, index asc) is ancestor-closed. Stable sort gives the index order.
    all_scores = torch.cat(scores)  # [N]
    order = torch.sort(-all_scores, stable=True).indices
    keep = order[: shape.budget].sort().values
    full = Draft(torch.cat(tokens)[None], torch.cat(parents), scores=all_scores)
    return full.subtree(keep)


_GROWERS = {ChainShape: _grow_chain, TreeShape: _grow_static, DynamicShape: _grow_dynamic}
