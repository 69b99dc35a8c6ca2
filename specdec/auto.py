"""Per-step draft shape policies: a fixed shape, or `auto`, which picks the fastest shape each step.

Owns `ShapePolicy` (what the loop asks before a step and tells after it), `FixedShape` (the same
concrete shape every step) and `AutoPolicy` (`shape="auto"`), and the registry `shape_policy` that
maps a shape config to its policy. Knows nothing about how drafts are grown or verified: a policy
only names a concrete shape (or none); the drafter grows it and the verifier checks it, so every
policy is exact by construction.

`AutoPolicy`, the estimator. Each step it maximizes expected committed tokens per second over a
fixed menu of static shapes, all width vectors (w_1, ..., w_D) with w_1 >= w_2 >= ... (each node at
depth d gets its w_d best children), D <= max_depth, w_1 <= max_width, at most max_nodes nodes,
plus "no draft":

    value(shape) = (1 + E[accepted]) / (scale * latency(1 + nodes, context) + draft_cost(D) + other)
    E[accepted]  = sum_{d=1..D} prod_{i<=d} q_i,   q_i = 1 - prod_{r < w_i} (1 - s[i, r])

- s[d, r]: probability that the sibling of rank r (r-th best) at depth d is accepted, given that
  its parent was accepted and ranks < r were not; a Beta(1, 3) prior (mean 0.25: a drafter earns
  its width), updated after every step from
  the verified draft: walking down the accepted path, each tried sibling at depth d adds one trial
  to s[d, r], and the accepted one a success. Depths are treated as independent (the estimate
  conditions on depth and rank only).
- latency(w, c): the target's measured `LatencyCurve` (`cached_latency`, measured once per
  target/device/dtype/machine/threads); `scale` is an exponential moving average (weight 0.2) of
  observed forward time / curve time, which absorbs machine load without re-measuring.
- draft_cost(D): the drafter's own measured cost (propose + commit) as an EMA (weight 0.3) per
  draft depth; a depth not yet observed costs (EMA of cost per depth) x D. The first drafted step
  (which also runs the prompt through a model drafter) is not counted.
- other: EMA (weight 0.2) of the rest of a step (acceptance, rollback, bookkeeping).
The estimates belong to the drafter object: later generations with the same drafter (and the same
auto config and target) start from what earlier ones learned; a new drafter starts from the prior.
Greedy output never depends on it; at temperature > 0 the shapes chosen, and so which random numbers
are drawn, depend on that history (a fixed shape reproduces a seed on its own).
When "no draft" wins for `probe` steps in a row, chain(1) is drafted once so that the estimates can
change; the interval doubles after each rejected probe and resets after an accepted one. Choosing
"no draft" costs nothing else: the drafter is not asked, and still hears every `commit`.
Steep curves (CPU, where 2 tokens cost ~1.4 one) give short chains or none; flat curves (GPU,
where 64 tokens cost about one) give wide trees.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Protocol

import numpy as np

from specdec import tree as tree_ops
from specdec.draft import Acceptance, Draft
from specdec.shapes import AutoShape, ChainShape, Shape, ShapeSpec, TreeShape

if TYPE_CHECKING:
    from specdec.metrics import StepRecord
    from specdec.models import Target


class ShapePolicy(Protocol):
    """Picks the shape each step drafts; the loop calls `choose` before and `observe` after a step."""

    def choose(self, context: int) -> Shape | None:
        """The concrete shape to draft next (None = draft nothing), `context` tokens committed."""

    def observe(self, draft: Draft, acceptance: Acceptance, record: StepRecord, context: int) -> None:
        """Take in one verified step (its draft, the verifier's decision and its timings)."""


class FixedShape:
    """The same concrete shape every step."""

    def __init__(self, shape: Shape, target: Target | None = None) -> None:
        self.shape = shape

    def choose(self, context: int) -> Shape | None:
        return self.shape

    def observe(self, draft: Draft, acceptance: Acceptance, record: StepRecord, context: int) -> None:
        pass


def candidate_widths(max_depth: int, max_width: int, max_nodes: int) -> list[tuple[int, ...]]:
    """Every non-increasing width vector of depth <= max_depth, widths <= max_width, at most
    max_nodes nodes, by depth and then widest first. Example (2, 2, 1): 2 + 4 + 4 = 10 nodes.
    Grown depth by depth from the vectors that still fit, so a wide `max_width` costs only the
    vectors within `max_nodes` (enumerating every combination first would not finish)."""
    out: list[tuple[int, ...]] = []
    level = [((), 1, 0)]  # (widths, nodes at the deepest level, nodes in all)
    for _ in range(max_depth):
        grown = []
        for widths, last, nodes in level:
            for w in range(min(widths[-1] if widths else max_width, max_width), 0, -1):
                if nodes + last * w <= max_nodes:
                    grown.append((widths + (w,), last * w, nodes + last * w))
        out.extend(widths for widths, _, _ in grown)
        level = grown
    return out


class AutoPolicy:
    """`shape="auto"`: the shape with the best expected tokens per second (module docstring)."""

    TARGET_WEIGHT, DRAFT_WEIGHT, OTHER_WEIGHT = 0.2, 0.3, 0.2

    def __init__(self, spec: AutoShape, target: Target | None = None) -> None:
        if spec.latency is None:
            if target is None:
                raise ValueError("shape='auto' needs a target (to measure its latency curve) or a given latency curve")
            from specdec.latency import cached_latency

            widths = tuple(w for w in (1, 2, 4, 8, 16, 32, 64, 128) if w < 2 * (spec.max_nodes + 1)) or (1,)
            self.curve = cached_latency(target, widths=widths)
        else:
            self.curve = spec.latency
        self.spec = spec
        self.widths = candidate_widths(spec.max_depth, spec.max_width, spec.max_nodes)
        depth = spec.max_depth
        # Column index per candidate and depth into s[d, :]; width 0 past a candidate's depth.
        self.width_table = np.zeros((len(self.widths), depth), dtype=np.int64)  # [C, D]
        for c, widths in enumerate(self.widths):
            self.width_table[c, : len(widths)] = widths
        self.nodes = np.array([sum(np.cumprod(w)) for w in self.widths], dtype=np.float64)  # [C]
        self.depths = np.array([len(w) for w in self.widths], dtype=np.int64)  # [C]
        self.trials = np.zeros((depth, spec.max_width))  # [D, W] per depth and sibling rank
        self.successes = np.zeros((depth, spec.max_width))
        self.scale = 1.0
        self.other = 0.0
        self.draft_cost: dict[int, float] = {}  # depth -> EMA seconds
        self.cost_per_depth: float | None = None
        self.drafted_steps = 0
        self.idle_steps = 0
        self.probe_interval = spec.probe
        self.probing = False

    # ---- estimates -------------------------------------------------------------------------------
    PRIOR_SUCCESSES, PRIOR_FAILURES = 1.0, 3.0

    def start(self) -> None:
        """A new generation: keep the estimates, restart the probing schedule."""
        self.idle_steps, self.probe_interval, self.probing = 0, self.spec.probe, False

    def acceptance(self) -> np.ndarray:
        """s[d, r] (module docstring): posterior means under the Beta(1, 3) prior. [D, W]"""
        return (self.successes + self.PRIOR_SUCCESSES) / (self.trials + self.PRIOR_SUCCESSES + self.PRIOR_FAILURES)

    def expected_accepted(self) -> np.ndarray:
        """E[accepted draft tokens] per candidate. [C]"""
        miss = np.cumprod(1.0 - self.acceptance(), axis=1)  # [D, W]: P(ranks 0..r all rejected)
        q = np.concatenate([np.zeros((miss.shape[0], 1)), 1.0 - miss], axis=1)  # [D, 1 + W], q[:, 0] = 0
        per_depth = q[np.arange(self.width_table.shape[1])[None], self.width_table]  # [C, D]
        return np.cumprod(per_depth, axis=1).sum(1)

    def _draft_seconds(self, depth: int) -> float:
        if depth in self.draft_cost:
            return self.draft_cost[depth]
        return (self.cost_per_depth or 0.0) * depth

    def values(self, context: int) -> tuple[np.ndarray, float]:
        """(expected tokens per second of each candidate [C], of drafting nothing)."""
        latency = {int(n): self.curve.at(int(n) + 1, context) for n in np.unique(self.nodes)}
        step = np.array([self.scale * latency[int(n)] + self._draft_seconds(int(d)) + self.other
                         for n, d in zip(self.nodes, self.depths)])
        none = 1.0 / max(1e-12, self.scale * self.curve.at(1, context) + self.other)
        return (1.0 + self.expected_accepted()) / np.maximum(step, 1e-12), none

    # ---- policy ----------------------------------------------------------------------------------
    def choose(self, context: int) -> Shape | None:
        values, none = self.values(context)
        best = int(values.argmax())
        self.probing = False
        if values[best] <= none:
            self.idle_steps += 1
            if self.idle_steps < self.probe_interval:
                return None
            self.probing = True
            return ChainShape(1)
        widths = self.widths[best]
        return ChainShape(len(widths)) if max(widths) == 1 else TreeShape(widths)

    def observe(self, draft: Draft, acceptance: Acceptance, record: StepRecord, context: int) -> None:
        predicted = self.curve.at(record.drafted + 1, context)
        if predicted > 0:
            ratio = record.target_time_s / predicted
            self.scale += self.TARGET_WEIGHT * (ratio - self.scale)
        self.other += self.OTHER_WEIGHT * (record.other_time_s - self.other)
        if not record.shape:  # nothing was asked of the drafter
            return
        self.idle_steps = 0
        if self.probing:
            self.probe_interval = self.spec.probe if acceptance.num_accepted else 2 * self.probe_interval
        self.drafted_steps += 1
        if self.drafted_steps > 1 and record.draft_depth:
            d, t = record.draft_depth, record.draft_time_s
            self.draft_cost[d] = t if d not in self.draft_cost else self.draft_cost[d] + self.DRAFT_WEIGHT * (
                t - self.draft_cost[d])
            per = t / d
            self.cost_per_depth = per if self.cost_per_depth is None else self.cost_per_depth + self.DRAFT_WEIGHT * (
                per - self.cost_per_depth)
        self._count_siblings(draft, acceptance)

    def _count_siblings(self, draft: Draft, acceptance: Acceptance) -> None:
        """Walk the accepted path: at each depth the children tried (by rank) and the one accepted."""
        kids = tree_ops.children(draft.parents)
        node = -1
        for depth in range(min(self.trials.shape[0], draft.depth)):
            accepted = acceptance.path[depth] if depth < len(acceptance.path) else None
            for rank, child in enumerate(kids[node][: self.trials.shape[1]]):
                self.trials[depth, rank] += 1
                if child == accepted:
                    self.successes[depth, rank] += 1
                    break
            if accepted is None:
                return
            node = accepted


_POLICIES = {AutoShape: AutoPolicy}
"""Shape configs that are policies rather than concrete shapes; any other shape is `FixedShape`."""
_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""drafter -> {(config, target id): its AutoPolicy}: estimates carried across generations."""


def shape_policy(spec: ShapeSpec, target: Target | None = None, drafter: object | None = None) -> ShapePolicy:
    """The policy for a parsed shape config: `FixedShape` for a concrete shape, else its registered
    one, reused from earlier generations of the same `drafter` (see the module docstring)."""
    factory = _POLICIES.get(type(spec))
    if factory is None:
        return FixedShape(spec, target)
    try:
        learned = _LEARNED.setdefault(drafter, {})
    except TypeError:  # None, or a drafter that cannot be weakly referenced or hashed: no memory
        return factory(spec, target)
    key = (spec, id(spec.latency), id(target))
    if key not in learned:
        learned[key] = factory(spec, target)
    learned[key].start()
    return learned[key]
