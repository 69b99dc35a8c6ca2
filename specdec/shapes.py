"""Draft shapes: chain, static tree and dynamic (EAGLE-2) tree, as data, and how to grow them.

Owns: the shape configs (`ChainShape`, `TreeShape`, `DynamicShape`), parsing of shape strings such
as `chain(4)`, `tree(4,2,2)`, `dynamic(top_k=8,depth=6,budget=32)`, and `grow_tree`, which builds a
`Draft` in any shape from a drafter's next-token logits. Knows nothing about which model produces
the logits: a drafter passes a `score` callback that runs its own model on new nodes.

How each shape uses the drafter's distribution:
- chain(k): one token per depth; greedy configs take the argmax, sampling configs *sample* from the
  drafter's distribution (processed with the same temperature/top-k/top-p as the target) and record
  it as `draft_probs`, so the verifier can run classic speculative sampling;
- tree(w1, w2, ...): every node at depth d gets its top-`w_d` children: deterministic (point-mass)
  siblings, verified by multi-candidate recursive rejection;
- dynamic(top_k, depth, budget): EAGLE-2. At each depth the `top_k` nodes with the best cumulative
  draft log-probability are expanded into their `top_k` best children; at the end all candidates
  are re-ranked by cumulative log-probability and the best `budget` nodes are kept (point-mass).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.draft import Draft
from specdec.sampling import SamplingConfig, target_probs_from_logits

# score(node_ids, tokens, parent_ids) -> logits [B, n, V] of the token after each listed node.
# node_ids / parent_ids are indices into the draft being grown (-1 = the root); a scored node's
# parent has always been scored before (or is the root), so a drafter can keep them in its cache.
ScoreFn = Callable[[list[int], torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class ChainShape:
    """A single sequence of k draft tokens (the 'sequence draft')."""

    k: int
    """Number of draft tokens, >= 1."""

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"chain(k) needs k >= 1, got {self.k!r}")

    @property
    def max_nodes(self) -> int:
        return self.k

    def __str__(self) -> str:
        return f"chain({self.k})"


@dataclass(frozen=True)
class TreeShape:
    """A static tree: every node at depth d (1-based) has widths[d-1] children."""

    widths: tuple[int, ...]
    """Branching per depth, each >= 1; len(widths) is the tree depth."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ValueError(f"tree(widths) needs at least one width and every width >= 1, got {self.widths}")

    @property
    def max_nodes(self) -> int:
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    def __str__(self) -> str:
        return f"tree({','.join(map(str, self.widths))})"


@dataclass(frozen=True)
class DynamicShape:
    """EAGLE-2 dynamic tree: expand the top_k best nodes per depth, keep the best `budget` nodes."""

    top_k: int = 8
    """Children per expanded node and nodes expanded per depth, >= 1."""
    depth: int = 6
    """Maximum draft depth, >= 1."""
    budget: int = 32
    """Nodes kept after re-ranking (the verification width), >= 1."""

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"dynamic({name}=...) must be an integer >= 1, got {value!r}")

    @property
    def max_nodes(self) -> int:
        return self.budget

    def __str__(self) -> str:
        return f"dynamic(top_k={self.top_k},depth={self.depth},budget={self.budget})"


Shape = ChainShape | TreeShape | DynamicShape
SHAPES: dict[str, type] = {"chain": ChainShape, "tree": TreeShape, "dynamic": DynamicShape}


def parse_shape(spec: str | Shape) -> Shape:
    """`chain(4)` | `tree(4,2,2)` | `dynamic(top_k=8,depth=6,budget=32)` (or a config) -> config."""
    if isinstance(spec, (ChainShape, TreeShape, DynamicShape)):
        return spec
    m = re.fullmatch(r"\s*(\w+)\s*\((.*)\)\s*", str(spec))
    if not m or m.group(1) not in SHAPES:
        raise ValueError(
            f"cannot parse draft shape {spec!r}; expected one of chain(k), tree(w1,w2,...), "
            "dynamic(top_k=K,depth=D,budget=N)"
        )
    kind, body = m.group(1), m.group(2)
    args, kwargs = [], {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        try:
            number = int(value if eq else key)
        except ValueError:
            raise ValueError(f"draft shape {spec!r}: {part!r} is not an integer") from None
        if eq:
            kwargs[key.strip()] = number
        else:
            args.append(number)
    if kind == "tree":
        if kwargs:
            raise ValueError(f"tree(...) takes positional widths only, got {spec!r}")
        return TreeShape(tuple(args))
    try:
        return SHAPES[kind](*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"draft shape {spec!r}: {err}") from None


def grow_tree(
    shape: Shape,
    root_logits: torch.Tensor,  # [B, V] drafter logits for the token after the root
    score: ScoreFn,
    sampling: SamplingConfig,
    generator: torch.Generator,
    max_depth: int,
) -> Draft:
    """Grow a draft in `shape` from a drafter's next-token logits (see the module docstring)."""
    if root_logits.shape[0] != 1:
        raise NotImplementedError(f"grow_tree supports batch size 1 only, got {root_logits.shape[0]}")
    if max_depth < 1:
        return Draft.empty(device=root_logits.device)
    grower = _GROWERS[type(shape)]
    return grower(shape, root_logits, score, sampling, generator, max_depth)


def _grow_chain(shape, root_logits, score, sampling, generator, max_depth) -> Draft:
    k = min(shape.k, max_depth)
    tokens, probs, logits = [], [], root_logits  # logits [B, V]
    for depth in range(k):
        if sampling.greedy:
            token = logits.argmax(-1, keepdim=True)  # [B, 1]
        else:
            p = target_probs_from_logits(logits, sampling)
            token = torch.multinomial(p, 1, generator=generator)
            probs.append(p)
        tokens.append(token)
        if depth + 1 < k:
            logits = score([depth], token, [depth - 1])[:, -1]
    draft_probs = torch.stack(probs, 1) if probs else None
    return Draft(torch.cat(tokens, 1), torch.arange(k) - 1, draft_probs)


def _grow_static(shape, root_logits, score, sampling, generator, max_depth) -> Draft:
    widths = shape.widths[:max_depth]
    tokens: list[torch.Tensor] = []  # each [B, 1]
    parents: list[int] = []
    frontier, frontier_logits = [-1], root_logits[:, None]  # logits [B, n_frontier, V]
    for depth, width in enumerate(widths):
        top = frontier_logits.topk(width, dim=-1).indices  # [B, n_frontier, width]
        level = []
        for f, parent in enumerate(frontier):
            for w in range(width):
                level.append(len(parents))
                parents.append(parent)
                tokens.append(top[:, f, w : w + 1])
        frontier = level
        if depth + 1 < len(widths):
            level_tokens = torch.cat([tokens[i] for i in level], 1)
            frontier_logits = score(level, level_tokens, [parents[i] for i in level])
    return Draft(torch.cat(tokens, 1), torch.tensor(parents, dtype=torch.long))


def _grow_dynamic(shape, root_logits, score, sampling, generator, max_depth) -> Draft:
    depth_limit = min(shape.depth, max_depth)
    k = shape.top_k
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []  # cumulative draft log-probability per node
    frontier, frontier_scores = [-1], torch.zeros(1)
    logprobs = root_logits[0].log_softmax(-1)[None].float()  # [n_frontier, V]
    for depth in range(depth_limit):
        # Children of each expanded node: its top_k next tokens.
        top_lp, top_tok = logprobs.topk(k, dim=-1)  # [n_frontier, k]
        child_scores = frontier_scores[:, None] + top_lp
        level = []
        for f, parent in enumerate(frontier):
            for j in range(k):
                level.append(len(parents))
                parents.append(parent)
                tokens.append(int(top_tok[f, j]))
                scores.append(float(child_scores[f, j]))
        if depth + 1 == depth_limit:
            break
        # Expand the top_k nodes of this level by cumulative score (stable: earlier nodes win ties).
        level_scores = torch.tensor([scores[i] for i in level])
        best = level_scores.topk(min(k, len(level))).indices.sort().values
        frontier = [level[i] for i in best.tolist()]
        frontier_scores = level_scores[best]
        level_tokens = torch.tensor([[tokens[i] for i in frontier]], device=root_logits.device)
        logprobs = score(frontier, level_tokens, [parents[i] for i in frontier])[0].log_softmax(-1).float()
    # Re-rank: a child's score never exceeds its parent's and parents have lower indices, so the
    # best `budget` under (score desc, index asc) is ancestor-closed.
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    keep = torch.tensor(sorted(order[: shape.budget]), dtype=torch.long)
    full = Draft(torch.tensor([tokens], device=root_logits.device), torch.tensor(parents, dtype=torch.long))
    return full.subtree(keep)


_GROWERS = {ChainShape: _grow_chain, TreeShape: _grow_static, DynamicShape: _grow_dynamic}
