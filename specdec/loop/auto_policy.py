"""`shape="auto"`: the estimator that picks the draft shape with the best expected tokens per second.

Owns `AutoPolicy` and `candidate_widths`: each step, the width vector (or no draft) maximizing (1 + E[accepted]) /
(scale * latency(1 + nodes) + propose + commit + other); the estimates are docs/design/auto.md's. Knows nothing
about how drafts are grown or verified.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.core import tree as tree_ops
from specdec.core.draft import Acceptance, Draft
from specdec.core.events import StepEvent
from specdec.core.shapes import AutoShape, ChainShape, Shape, TreeShape

if TYPE_CHECKING:
    from specdec.runtime.model import Target


def _ema(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average: `new` on the first observation (old is None)."""
    return new if old is None else old + weight * (new - old)


def candidate_widths(max_depth: int, max_width: int, max_nodes: int) -> list[tuple[int, ...]]:
    """Every non-increasing width vector of depth <= max_depth, widths <= max_width, at most max_nodes nodes
    (e.g. (2, 2, 1): 2 + 4 + 4 = 10), by depth then widest first; grown only from vectors that still fit."""
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
    """`shape="auto"`: the shape with the best expected tokens per second (docs/design/auto.md)."""

    TARGET_WEIGHT, DRAFT_WEIGHT, OTHER_WEIGHT = 0.2, 0.3, 0.2

    def __init__(self, spec: AutoShape, target: Target | None = None, cache: str = "dynamic", batch: int = 1) -> None:
        if spec.latency is None:
            if target is None:
                raise ValueError("shape='auto' needs a target (to measure its latency curve) or a given latency curve")
            from specdec.loop.tuned import tuned_latency

            self.curve = tuned_latency(target, cache=cache, batch=batch)
        else:
            self.curve = spec.latency
        self.batch = batch
        self.spec = spec
        self.max_nodes = spec.max_nodes
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
        self.draft_cost: dict[int, float] = {}  # depth -> EMA seconds of propose
        self.cost_per_depth: float | None = None  # EMA of propose seconds / depth
        self.commit_cost = 0.0  # EMA seconds of the drafter's commit, every step
        self.recent_draft_cost: float | None = None  # EMA of every drafted step's cost, probes included
        self.drafted_steps = 0
        self.idle_steps = 0
        self.probe_interval = spec.probe
        self.probing = False
        self.probed = False  # a probe was verified since the last choice
        # Trimming (docs/design/auto.md): calibration cells [depth bucket, confidence bin], survival per
        # depth and sibling rank.
        centers = (np.arange(self.BINS) + 0.5) / self.BINS
        self.calib_prior = np.stack([self.CALIB_WEIGHT * centers, self.CALIB_WEIGHT * (1 - centers)])  # [2, bins]
        self.calib_trials = np.zeros((3, self.BINS))
        self.calib_successes = np.zeros((3, self.BINS))
        self.asked = np.zeros((depth, spec.max_width))  # [D, W] children asked of verified parents
        self.kept = np.zeros((depth, spec.max_width))  # [D, W] of those, verified (after trimming)
        self.asked_path = np.zeros((depth, spec.max_width))  # [D, W] the same, of accepted parents (and the root)
        self.kept_path = np.zeros((depth, spec.max_width))
        self.trims = False  # True once a drafter has handed in scored drafts
        self._deepest: int | None = None  # the cheap path's candidate (see choose)
        self._latency_rows: dict[int, np.ndarray] = {}
        self._plan: tuple | None = None  # see values
        self._featured: tuple[Draft, tuple | None] | None = None  # the last draft _features read, and its result

    # ---- estimates -------------------------------------------------------------------------------
    PRIOR_SUCCESSES, PRIOR_FAILURES = 1.0, 3.0
    BINS, CALIB_WEIGHT, CHEAP, LONGEST_PROBE_INTERVAL, REPLAN = 10, 2.0, 0.03, 64, 4

    def start(self) -> None:
        """A new generation: keep the estimates and the probing schedule (idle steps count across generations, so
        generations shorter than the probe interval still probe)."""
        self.probing = False

    def acceptance(self, optimistic: bool = False) -> np.ndarray:
        """s[d, r] (docs/design/auto.md): posterior means, each depth's prior centred on the depth above (depth 1:
        Beta(1, 3)); `optimistic`: s+, plus `spec.explore` posterior standard deviations (capped at 1). [D, W]"""
        weight = self.PRIOR_SUCCESSES + self.PRIOR_FAILURES
        prior = np.full(self.trials.shape[1], self.PRIOR_SUCCESSES / weight)
        out = np.empty_like(self.trials)
        for d in range(self.trials.shape[0]):
            out[d] = prior = (self.successes[d] + weight * prior) / (self.trials[d] + weight)
        if optimistic:
            out = np.minimum(1.0, out + self.spec.explore * np.sqrt(out * (1 - out) / (self.trials + weight + 1)))
        return out

    def survival(self, on_path: bool = False) -> np.ndarray:
        """v[d, r]: P(the rank-r child at depth d is verified | its parent is) under trimming (1
        without it); `on_path`: u[d, r], the same given that its parent was accepted. [D, W]"""
        if not self.trims:
            return np.ones_like(self.kept)
        weight = self.PRIOR_SUCCESSES + self.PRIOR_FAILURES  # prior: `weight` of `weight` children kept
        v = (self.kept + weight) / (self.asked + weight)
        return (self.kept_path + weight * v) / (self.asked_path + weight) if on_path else v

    def _per_depth(self, per_rank: np.ndarray) -> np.ndarray:
        """[D, W] per depth and rank -> [C, D]: each candidate's sum over its ranks r < w_d."""
        summed = np.concatenate([np.zeros((per_rank.shape[0], 1)), np.cumsum(per_rank, axis=1)], axis=1)  # [D, 1 + W]
        return summed[np.arange(self.width_table.shape[1])[None], self.width_table]

    def expected_accepted(self, optimistic: bool = False) -> np.ndarray:
        """E[accepted draft tokens] per candidate (`optimistic`: under s+ rather than s). [C]"""
        # [D, W] P(rank r verified and accepted | parent accepted, earlier ranks not)
        tried = self.acceptance(optimistic) * self.survival(on_path=True)
        miss = np.cumprod(1.0 - tried, axis=1)  # [D, W]: P(ranks 0..r all not accepted)
        q = np.concatenate([np.zeros((miss.shape[0], 1)), 1.0 - miss], axis=1)  # [D, 1 + W], q[:, 0] = 0
        per_depth = q[np.arange(self.width_table.shape[1])[None], self.width_table]  # [C, D]
        return np.cumprod(per_depth, axis=1).sum(1)

    def expected_verified(self) -> np.ndarray:
        """Draft nodes each candidate is expected to verify after trimming. [C]"""
        if not self.trims:
            return self.nodes
        return np.cumprod(self._per_depth(self.survival()), axis=1).sum(1)

    def calibrated(self, conf: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """c[bucket, bin]: calibrated P(accepted | parent accepted) for confidences in [0, 1]. [N]"""
        cell = self._cells(conf, depth)
        a = self.calib_successes[cell] + self.calib_prior[0][cell[1]]
        return a / (self.calib_trials[cell] + self.CALIB_WEIGHT)

    def _latency_row(self, context: int, width: int) -> np.ndarray:
        """latency(1 + k, context) for k = 0..width, cached per 16 tokens of context. [width + 1]"""
        key = context // 16
        row = self._latency_rows.get(key)
        if row is None or len(row) <= width:
            row = np.array([self.curve.at(1 + k, key * 16) for k in range(max(width, self.spec.max_nodes) + 1)])
            row = np.maximum.accumulate(row)  # more tokens never cost less: a measured dip is noise
            self._latency_rows[key] = row
        return row[: width + 1]

    def _draft_seconds(self, depth: int) -> float:
        if depth in self.draft_cost:
            return self.draft_cost[depth]
        return (self.cost_per_depth or 0.0) * depth

    def values(self, context: int) -> tuple[np.ndarray, float]:
        """(expected tokens per second of each candidate [C], of drafting nothing). What only drafted steps change
        (acceptance, survival, drafting cost) is planned again after a probe and every REPLAN drafted steps; the
        load scale and the per-step costs every step, so most steps plan with a few vector operations."""
        row = self._latency_row(context, self.spec.max_nodes)  # [max_nodes + 1]
        key = (self.trims, context // 16)
        if (self._plan is None or self._plan[0] != key or self.probed
                or self.drafted_steps >= self._plan[1] + self.REPLAN):
            latency = np.interp(self.expected_verified(), np.arange(len(row)), row)  # [C], linear between widths
            draft = {int(d): self._draft_seconds(int(d)) for d in np.unique(self.depths)}
            gain = 1.0 + self.expected_accepted(optimistic=True)
            self._plan = (key, self.drafted_steps, gain, latency, np.array([draft[int(d)] for d in self.depths]))
        _, _, gain, latency, draft = self._plan
        step = self.scale * latency + draft + (self.commit_cost + self.other)
        none = 1.0 / max(1e-12, self.scale * row[0] + self.commit_cost + self.other)
        return gain / np.maximum(step, 1e-12), none

    # ---- policy ----------------------------------------------------------------------------------
    def choose(self, context: int) -> Shape | None:
        self.probing = False
        # With trimming, a proposal costs at most its drafting (trim may verify nothing), so a drafter
        # whose drafted steps cost under CHEAP of a one-token step is always asked: for the deepest
        # shape with the most expected acceptances (re-ranked every 8 drafted steps).
        one_token = self.scale * self._latency_row(context, 0)[0] + self.other
        cheap = self.trims and self.recent_draft_cost is not None and self.recent_draft_cost <= self.CHEAP * one_token
        if cheap:
            if self._deepest is None or self.drafted_steps % 8 == 0:
                deepest = np.flatnonzero(self.depths == self.depths.max())
                self._deepest = int(deepest[self.expected_accepted()[deepest].argmax()])
            best = self._deepest
        else:
            values, none = self.values(context)
            best = int(values.argmax())
        if not cheap and values[best] <= none:
            if self.probed:  # the last probe left "no draft" the best: wait twice as long for the next one
                longest = max(self.spec.probe, self.LONGEST_PROBE_INTERVAL)
                self.probe_interval, self.probed = min(2 * self.probe_interval, longest), False
            self.idle_steps += 1
            if self.idle_steps < self.probe_interval:
                return None
            self.probing = True
            return ChainShape(1)
        self.probe_interval, self.probed = self.spec.probe, False
        widths = self.widths[best]
        return ChainShape(len(widths)) if max(widths) == 1 else TreeShape(widths)

    def _features(self, draft: Draft) -> tuple[np.ndarray, np.ndarray] | None:
        """(own confidence, depth) per node of a draft trimming may cut: scored and point-mass (module
        docstring, "Trimming"); None for any other draft, or with trimming off."""
        if not self.spec.trim or not draft.num_nodes or draft.scores is None or draft.draft_probs is not None:
            return None
        if self._featured is not None and self._featured[0] is draft:  # keep's, read again by observe
            return self._featured[1]
        parents, scores = draft.parents.tolist(), draft.scores.tolist()
        own = [scores[i] - (scores[parent] if parent >= 0 else 0.0) for i, parent in enumerate(parents)]
        self._featured = (draft, (np.minimum(np.exp(own), 1.0), tree_ops.depths(draft.parents).numpy()))
        return self._featured[1]

    def keep(self, draft: Draft, context: int) -> torch.Tensor | None:
        """The nodes of `draft` worth verifying (docs/design/auto.md, "Trimming"); None (all of them) when
        trimming is off or the drafter gave no scores."""
        features = self._features(draft)
        if features is None:
            return None
        self.trims = True
        if self.probing or self.batch > 1:
            return None  # a probe is verified whole (it exists to give the estimates data), and so is a
            # batch's draft: one row's extra nodes cost the batch nothing unless that row is the widest
        path, parents = self.calibrated(*features).tolist(), draft.parents.tolist()
        for i, parent in enumerate(parents):
            if parent >= 0:
                path[i] *= path[parent]
        order = sorted(range(len(path)), key=lambda i: (-path[i], i))  # best first; parents before children
        gain = 1.0 + np.concatenate([[0.0], np.cumsum([path[i] for i in order])])  # [N + 1]
        value = gain / (self.scale * self._latency_row(context, len(path)) + self.other)
        k = int(value.argmax())
        return None if k == len(path) else torch.tensor(sorted(order[:k]), dtype=torch.long)

    def observe(self, event: StepEvent, row: int) -> None:
        proposal, draft, acceptance, times = event.proposals[row], event.drafts[row], event.acceptances[row], event.times
        keep = None if event.kept[row] is None else event.kept[row].numpy()
        predicted = self.curve.at(draft.num_nodes + 1, event.contexts[row] + len(event.committed[row]))
        if predicted > 0:
            self.scale += self.TARGET_WEIGHT * (times.forward / predicted - self.scale)
        self.other += self.OTHER_WEIGHT * (times.choose + times.accept - self.other)
        self.commit_cost += self.DRAFT_WEIGHT * (times.commit - self.commit_cost)
        if event.shape is None:  # nothing was asked of the drafter
            return
        self.idle_steps = 0
        self.probed = self.probing
        self.drafted_steps += 1
        if self.trims:
            features = self._features(proposal)
            self._count_survivors(proposal, keep, event.shape.widths, acceptance.path)
            if features is not None and draft.num_nodes:
                self._calibrate(draft, acceptance, features, keep)
            if features is not None and keep is not None and acceptance.bonus:
                self._calibrate_trimmed(proposal, keep, acceptance, features)
        if self.drafted_steps > 1 and proposal.depth:
            d, t = proposal.depth, times.propose
            self.draft_cost[d] = _ema(self.draft_cost.get(d), t, self.DRAFT_WEIGHT)
            self.recent_draft_cost = _ema(self.recent_draft_cost, times.propose + times.commit, self.DRAFT_WEIGHT)
            self.cost_per_depth = _ema(self.cost_per_depth, t / d, self.DRAFT_WEIGHT)
        self._count_siblings(draft, acceptance)

    def _count_survivors(self, proposal: Draft, keep: np.ndarray | None, widths: tuple[int, ...],
                         path: list[int]) -> None:
        """v's and u's counts: each verified node (and the root) at depth d < len(widths) was asked for widths[d]
        children; per rank one trial of v, kept if that child was proposed and verified; the root and the accepted
        nodes (`path`, indices into the verified draft) add the same trials to u."""
        count = proposal.num_nodes
        verified = np.ones(count, dtype=bool) if keep is None else np.isin(np.arange(count), keep)
        accepted = {-1, *(path if keep is None else keep[list(path)].tolist())}  # proposal indices
        kids = tree_ops.children(proposal.parents)  # kids[-1]: the root's
        depth = np.append(tree_ops.depths(proposal.parents).numpy(), 0)  # depth[-1] = 0: the root
        for node in [-1, *np.flatnonzero(verified).tolist()]:
            d = int(depth[node])
            if d >= min(len(widths), self.asked.shape[0]):
                continue
            children = kids[node]
            for rank in range(min(widths[d], self.asked.shape[1])):
                kept = rank < len(children) and bool(verified[children[rank]])
                self.asked[d, rank] += 1
                self.kept[d, rank] += kept
                if node in accepted:
                    self.asked_path[d, rank] += 1
                    self.kept_path[d, rank] += kept

    def _cells(self, conf: np.ndarray, depth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Calibration cells (depth bucket, confidence bin) of nodes."""
        return np.minimum(depth, 3) - 1, np.minimum((conf * self.BINS).astype(np.int64), self.BINS - 1)

    def _calibrate(self, draft: Draft, acceptance: Acceptance, features: tuple[np.ndarray, np.ndarray],
                   keep: np.ndarray | None) -> None:
        """Each verified node whose parent was accepted (or is the root): one trial of its cell."""
        conf, depth = features if keep is None else (features[0][keep], features[1][keep])
        accepted = np.zeros(draft.num_nodes, dtype=bool)
        accepted[acceptance.path] = True
        parents = draft.parents.numpy()
        tried = np.where(parents >= 0, accepted[np.maximum(parents, 0)], True)
        cell = self._cells(conf[tried], depth[tried])
        np.add.at(self.calib_trials, cell, 1.0)
        np.add.at(self.calib_successes, cell, accepted[tried].astype(np.float64))

    def _calibrate_trimmed(self, proposed: Draft, keep: np.ndarray, acceptance: Acceptance,
                           features: tuple[np.ndarray, np.ndarray]) -> None:
        """Trimmed children of the last accepted node (or of the root), when the step ended on a bonus token: "child ==
        next token" is then a fair trial of the child (exact at T = 0)."""
        last = int(keep[acceptance.path[-1]]) if acceptance.path else -1  # index in the proposal
        kids = np.flatnonzero(proposed.parents.numpy() == last)
        kids = kids[~np.isin(kids, keep)]
        if not len(kids):
            return
        conf, depth = features
        cell = self._cells(conf[kids], depth[kids])
        np.add.at(self.calib_trials, cell, 1.0)
        np.add.at(self.calib_successes, cell, (proposed.tokens[0, kids].cpu().numpy() == acceptance.next_token).astype(np.float64))

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
