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
  are re-ranked by cumulative log-probability and the best `budget` nodes are kept (point-mass,
  with `Draft.scores` = each node's cumulative draft log-probability, as chains and static trees
  also record);
- auto(...): not grown here: `specdec.core.policy` picks one of the shapes above (or none) per step.
All growers work on tensors on the drafter's device (no per-node Python scalars).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.core.draft import Draft
from specdec.core.sampling import SamplingConfig, target_probs_from_logits

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


@dataclass(frozen=True)
class AutoShape:
    """Choose a static shape (or no draft) every step from measured costs: see `specdec.core.policy`."""

    max_depth: int = 8
    """Deepest draft considered, >= 1."""
    max_width: int = 4
    """Most children per node considered (1 = chains only), >= 1."""
    max_nodes: int = 32
    """Most draft nodes verified in one step, >= 1."""
    probe: int = 4
    """After this many steps without a draft, draft chain(1) once to refresh the estimates; the
    interval doubles after each probe that is rejected (resets on an accepted one). >= 1."""
    trim: int = 1
    """1: when the drafter scores its nodes (`Draft.scores`), verify only the subtree with the best
    expected tokens per second under calibrated confidences (`specdec.core.policy`); 0: verify every node."""
    explore: int = 1
    """Optimism of the shape choice, in posterior standard deviations of each acceptance estimate
    (`specdec.core.policy`); 0: choose on the plain estimates. >= 0."""
    latency: Any = field(default=None, compare=False)
    """A `specdec.measure.latency.LatencyCurve` to use (tests, offline curves); None = the curve tuned for
    this machine, else the untuned default (`specdec.measure.latency.tuned_latency`). Not settable from a string."""

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_width", "max_nodes", "probe"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"auto({name}=...) must be an integer >= 1, got {value!r}")
        if self.trim not in (0, 1) or isinstance(self.trim, bool):
            raise ValueError(f"auto(trim=...) must be 0 or 1, got {self.trim!r}")
        if not isinstance(self.explore, int) or isinstance(self.explore, bool) or self.explore < 0:
            raise ValueError(f"auto(explore=...) must be an integer >= 0, got {self.explore!r}")

    def __str__(self) -> str:
        trim = "" if self.trim else ",trim=0"
        explore = "" if self.explore == 1 else f",explore={self.explore}"
        return f"auto(max_depth={self.max_depth},max_width={self.max_width},max_nodes={self.max_nodes}{trim}{explore})"


Shape = ChainShape | TreeShape | DynamicShape
"""A concrete draft shape: what a drafter is asked to grow."""
ShapeSpec = Shape | AutoShape
"""What `generate` accepts: a concrete shape, or `auto` (a concrete shape chosen per step)."""
SHAPES: dict[str, type] = {"chain": ChainShape, "tree": TreeShape, "dynamic": DynamicShape, "auto": AutoShape}
_KEYWORD_ONLY = {"auto": ("max_depth", "max_width", "max_nodes", "probe", "trim", "explore")}


def parse_shape(spec: str | ShapeSpec) -> ShapeSpec:
    """`chain(4)` | `tree(4,2,2)` | `dynamic(top_k=8,depth=6,budget=32)` | `auto` |
    `auto(max_depth=D,max_width=W,max_nodes=N,probe=P,trim=T,explore=E)` (or a config) -> config."""
    if isinstance(spec, (ChainShape, TreeShape, DynamicShape, AutoShape)):
        return spec
    if isinstance(spec, str) and spec.strip() == "auto":
        return AutoShape()
    m = re.fullmatch(r"\s*(\w+)\s*\((.*)\)\s*", str(spec))
    if not m or m.group(1) not in SHAPES:
        raise ValueError(
            f"cannot parse draft shape {spec!r}; expected one of chain(k), tree(w1,w2,...), "
            "dynamic(top_k=K,depth=D,budget=N), auto or auto(max_depth=D,max_width=W,max_nodes=N,probe=P,trim=T,explore=E)"
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
    if kind in _KEYWORD_ONLY:
        unknown = sorted(set(kwargs) - set(_KEYWORD_ONLY[kind]))
        if args or unknown:
            given = ", ".join(unknown) if unknown else f"positional {args}"
            raise ValueError(f"draft shape {spec!r}: {kind}(...) takes only keyword options "
                             f"{', '.join(_KEYWORD_ONLY[kind])}; unknown: {given}")
    if kind == "tree":
        if kwargs:
            raise ValueError(f"tree(...) takes positional widths only, got {spec!r}")
        return TreeShape(tuple(args))
    try:
        return SHAPES[kind](*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"draft shape {spec!r}: {err}") from None


@dataclass(frozen=True)
class SubVocab:
    """A drafter's reduced vocabulary: column j of its logits is target token `ids[j]`.

    Growers rank and sample within the columns and map the chosen columns back through `ids`, so a
    drafter scoring 4,096 of 49,152 tokens never builds a 49,152-wide tensor (sampling chains
    expand their `draft_probs` to the full vocabulary once per draft, since the verifier needs them).
    """

    ids: torch.Tensor  # [Vd] long target token ids, on the drafter's device
    size: int
    """The full (target) vocabulary size V."""

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

    `vocab` (None = the logits cover the whole vocabulary) maps logit columns to token ids; `score`
    then returns logits over the same columns and is passed target token ids. Widths and top_k larger
    than the number of columns are clamped to it (a node cannot have more distinct children).
    Host syncs: none for chains and static trees beyond sampling's; one per expanded depth for
    dynamic trees (the expanded node ids `score` receives) and one for the final selection.
    """
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
