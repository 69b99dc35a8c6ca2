"""Acceptance profiles: one greedy decode, every position's draft, and shape sweeps by replay.

Owns `profile(...)` and `AcceptanceProfile` (`simulate(shape)`, `pooled_mal`, `counts()`, without a model): a node at
depth d of the draft at position p is accepted iff its path equals the greedy g[p:p+d]. Knows nothing about latency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core import tree as tree_ops
from specdec.core.draft import Draft, Drafter
from specdec.loop.decode import DecodeConfig, cut_at_eos, decode, encode_prompts
from specdec.loop.policy import ProposeOnly
from specdec.runtime.model import Target
from specdec.core.shapes import DynamicShape, Shape, parse_shape
from specdec.core.acceptance import accept_greedy


class UnderivableShapeError(ValueError):
    """A shape whose drafts cannot be cut out of the recorded ones."""


@dataclass(frozen=True)
class ProfileCounts:
    """Acceptance per depth and sibling rank over every recorded position (not per real step)."""

    reached: list[int]  # reached[d - 1]: positions whose draft had a node at depth d.
    tried: list[int]
    """tried[d - 1]: positions whose accepted path reached depth d - 1 at a node with children (the
    target looked for a depth-d token among the draft's)."""
    accepted: list[int]  # accepted[d - 1]: positions whose accepted path reached depth d.
    by_rank: list[list[int]]
    """by_rank[d - 1][r]: positions whose accepted node at depth d was its parent's child of rank r
    (0 = first child, the drafter's best)."""
    positions: int  # Positions recorded.

    def rate_by_depth(self) -> list[float]:
        """P(a depth-d node is accepted | depth d - 1 was and has children), per d (NaN if never tried)."""
        return [a / t if t else math.nan for a, t in zip(self.accepted, self.tried)]


@dataclass
class AcceptanceProfile:
    """One greedy decode and the drafter's draft at each of its positions (see the module docstring)."""

    target: str  # The target's label.
    drafter: str
    shape: Shape  # The shape every recorded draft was asked in.
    prompt_ids: list[int]
    greedy: list[int]  # The target's greedy continuation, max_new_tokens long (not cut at EOS).
    drafts: list[Draft]
    """drafts[p]: the draft proposed after p generated tokens (on CPU, already cut to the depth the
    loop would allow there: max_new_tokens - p - 1)."""
    eos: set[int]  # Tokens that end a real run (empty when the profile was made with stop_on_eos=False).

    @property
    def max_new_tokens(self) -> int:
        return len(self.greedy)

    def accepted_at(self, position: int, draft: Draft) -> list[int]:
        """Accepted path (node indices) of `draft` made after `position` generated tokens."""
        depth = torch.cat([torch.zeros(1, dtype=torch.long), tree_ops.depths(draft.parents)])  # [N + 1]
        argmax = torch.tensor(self.greedy)[position + depth]  # the greedy token after each node
        return accept_greedy(draft, argmax).path

    def derive(self, shape: str | Shape, position: int) -> Draft:
        """The draft a real run in `shape` would get at `position`, cut out of the recorded one."""
        keep = _derivable(self.shape, parse_shape(shape), self.drafts[position])
        return self.drafts[position].subtree(keep)

    def accepted_per_step(self, shape: str | Shape, temperature: float = 0.0) -> list[int]:
        """Accepted tokens (bonus excluded) of each step of a greedy run in `shape`, replayed, committing what the loop
        would (up to the first EOS, within max_new_tokens): 1 + sum / len is the run's own MAL."""
        _greedy_only(temperature, "simulated")
        shape = parse_shape(shape)
        _derivable(self.shape, shape, None)  # fail before any work for a wrong kind of shape
        position, steps = 0, []
        while position < self.max_new_tokens:
            accepted = len(self.accepted_at(position, self.derive(shape, position)))
            new = cut_at_eos(self.greedy[position:position + accepted + 1], self.eos)
            steps.append(len(new) - 1)
            position += len(new)
            if self.eos.intersection(new):
                break
        return steps

    def simulate(self, shape: str | Shape, temperature: float = 0.0) -> float:
        """MAL (mean tokens per target forward, bonus included) of a real greedy run in `shape`."""
        steps = self.accepted_per_step(shape, temperature)
        return 1.0 + sum(steps) / len(steps)

    def counts(self) -> ProfileCounts:
        """Per-depth and per-rank acceptance of the recorded drafts at every position."""
        depth = max((d.depth for d in self.drafts), default=0)
        reached, tried, accepted = [0] * depth, [0] * depth, [0] * depth
        widest = max((len(k) for d in self.drafts for k in tree_ops.children(d.parents)), default=0)
        by_rank = [[0] * widest for _ in range(depth)]
        for position, draft in enumerate(self.drafts):
            for d in range(draft.depth):
                reached[d] += 1
            kids = tree_ops.children(draft.parents)
            path = self.accepted_at(position, draft)
            for d, parent in enumerate([-1] + path):
                if kids[parent]:
                    tried[d] += 1
                if d < len(path):
                    accepted[d] += 1
                    by_rank[d][kids[parent].index(path[d])] += 1
        return ProfileCounts(reached=reached, tried=tried, accepted=accepted, by_rank=by_rank,
                             positions=len(self.drafts))


def pooled_mal(profiles: Sequence[AcceptanceProfile], shape: str | Shape) -> float:
    """MAL of greedy runs in `shape` over several profiles (e.g. a prompt suite), steps pooled as
    `GenerationStats.merge` pools them: 1 + accepted tokens / steps."""
    if not profiles:
        raise ValueError("pooled_mal needs at least one profile")
    steps = [accepted for prof in profiles for accepted in prof.accepted_per_step(shape)]
    return 1.0 + sum(steps) / len(steps)


def _greedy_only(temperature: float, what: str) -> None:
    if temperature != 0.0:
        raise ValueError(f"an acceptance profile is {what} at temperature 0 only, got {temperature}: at T > 0 "
                         "acceptance is random and depends on the draft probabilities, so replaying a recorded "
                         "greedy decode says nothing about it; measure T > 0 with specdec.generate")


def _ranks(parents: torch.Tensor) -> list[int]:
    """Each node's rank among its parent's children (index order)."""
    rank = [0] * parents.numel()
    for kids in tree_ops.children(parents):
        for r, node in enumerate(kids):
            rank[node] = r
    return rank


def _derivable(recorded: Shape, wanted: Shape, draft: Draft | None) -> torch.Tensor | None:
    """Nodes of `draft` (recorded in `recorded`) that a `wanted` draft keeps; with draft=None only
    checks that `wanted` is derivable. Raises UnderivableShapeError saying why not."""
    asked = f"cannot simulate {wanted} from a profile recorded in {recorded}"

    def fail(why: str):
        raise UnderivableShapeError(f"{asked}: {why}")

    if wanted == recorded:
        return None if draft is None else torch.arange(draft.num_nodes)
    if not isinstance(wanted, DynamicShape) and not isinstance(recorded, DynamicShape):  # chains, static trees:
        # each node at depth d has up to widths[d - 1] children by rank (a chain: the top-ranked path)
        if wanted.depth > recorded.depth:
            fail(f"it is {wanted.depth} deep, the recorded drafts only {recorded.depth}; record a deeper shape")
        wider = [d + 1 for d, (w, r) in enumerate(zip(wanted.widths, recorded.widths)) if w > r]
        if wider:
            fail(f"it is wider than the recorded drafts at depth {wider[0]}; record a wider shape")
        if draft is None:
            return None
        rank, depth = _ranks(draft.parents), tree_ops.depths(draft.parents).tolist()
        keep: list[int] = []
        ok = [False] * draft.num_nodes
        for i, p in enumerate(draft.parents.tolist()):
            ok[i] = (p < 0 or ok[p]) and depth[i] <= wanted.depth and rank[i] < wanted.widths[depth[i] - 1]
            if ok[i]:
                keep.append(i)
        return torch.tensor(keep, dtype=torch.long)
    if isinstance(wanted, DynamicShape) and isinstance(recorded, DynamicShape):
        if (wanted.top_k, wanted.depth) != (recorded.top_k, recorded.depth):
            fail("a dynamic tree replays only with the recorded top_k and depth (they decide which nodes grow); "
                 "only a smaller budget can be cut out")
        if wanted.budget > recorded.budget:
            fail(f"budget {wanted.budget} exceeds the recorded budget {recorded.budget}; record a larger budget")
        if draft is None:
            return None
        if draft.scores is None:
            fail("the drafter recorded no Draft.scores (cumulative draft log-probabilities), which a smaller "
                 "budget re-ranks by")
        # The grower keeps the best `budget` nodes by (score desc, growth index asc): the best
        # `wanted.budget` of the recorded best are the best overall, and ancestor-closed.
        order = sorted(range(draft.num_nodes), key=lambda i: (-float(draft.scores[i]), int(draft.node_ids[i])))
        return torch.tensor(sorted(order[: wanted.budget]), dtype=torch.long)
    fail(f"a {type(wanted).__name__} cannot be cut out of {type(recorded).__name__} drafts "
         "(derivable: shorter chains and narrower or shallower trees from chains and static trees, "
         "smaller budgets from a dynamic tree with the same top_k and depth)")


@torch.inference_mode()
def profile(
    target: Target,
    drafter: Drafter,
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    shape: str | Shape = "chain(6)",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    chat: bool = True,
    stop_on_eos: bool = True,
) -> AcceptanceProfile:
    """Run `target`'s greedy decode of `prompt` for `max_new_tokens` tokens (past EOS, so replays can cross it;
    `stop_on_eos` only tells replays to end there) and record `drafter`'s draft in `shape` at every position."""
    _greedy_only(temperature, "recorded")
    shape = parse_shape(shape)
    rows = encode_prompts(target, [prompt], chat)
    config = DecodeConfig(shape=ProposeOnly(shape), max_new_tokens=max_new_tokens, stop_on_eos=False, cache="dynamic")
    drafts, greedy = [], []
    for event in decode(target, drafter, rows, config):
        drafts.append(_to_cpu(event.proposals[0]))
        greedy.extend(event.committed[0])
    return AcceptanceProfile(target=target.label, drafter=drafter.name, shape=shape, prompt_ids=rows[0],
                             greedy=greedy, drafts=drafts, eos=target.eos_token_ids if stop_on_eos else set())


def _to_cpu(draft: Draft) -> Draft:
    """The draft without draft probabilities (greedy replays never read them), on CPU."""
    scores = None if draft.scores is None else draft.scores.detach().float().cpu()
    return Draft(draft.tokens.cpu(), draft.parents, None, draft.node_ids, scores)
