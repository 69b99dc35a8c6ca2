"""The statistical cases of an exactness certificate, and the checks run on every draft. Owns:
- `chi_square_p` / `binned_chi_square`: Pearson's chi-square with cells binned by the expected counts (never the
  observed ones);
- `reference_law`, `exact_law`, `pick_eos`: the target's exact law of the first few tokens, and a case's stop token;
- `distribution_case`: n seeded generations through `specdec.generate` (any shape and cache) against the exact law;
- `Recorder`: checks each draft: `draft_probs` [B, N, V] rows sum to 1 and give every proposed token mass, the draft
  fits the requested shape, and per depth the sampled tokens match `draft_probs` (`draft_probability_p`); a draft
  without `draft_probs` is point-mass, which the verifier handles exactly;
- `greedy_case`: the greedy identity against the cacheless reference.
Knows nothing about particular registered drafters or about mutants.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from scipy.stats import chisquare

import specdec
from specdec.core import tree as tree_ops
from specdec.core.draft import Draft, Drafter, DraftRequest, Step
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import AutoShape, ChainShape, DynamicShape, ShapeSpec, TreeShape
from specdec.loop.reference import next_token_logits, reference_generate
from specdec.runtime.model import Target

LENGTH = 3
"""Tokens per generation compared with the exact law (the joint of the first LENGTH tokens)."""
SAMPLINGS = {
    "plain": SamplingConfig(temperature=1.0),
    "top-k": SamplingConfig(temperature=0.8, top_k=3),
    "top-p": SamplingConfig(temperature=0.7, top_p=0.8),
}
"""The T > 0 samplings (top-p at T != 1: a nucleus taken before the temperature moves the law)."""
SAMPLE_PROMPT = (1, 2, 3, 1, 2)
"""Prompt of the T > 0 cases; its repeats give prompt-lookup drafters something to propose."""
GREEDY_PROMPTS = ([1, 5, 9, 5, 9, 5, 9, 13], [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 2, 3, 5])
"""Prompts of the greedy identity (vocabulary 64)."""
SUM_TOLERANCE = 1e-4
"""How far from 1 a row of `draft_probs` may sum."""


# ---- chi-square ----------------------------------------------------------------------------------


def bins(expected: Sequence[float]) -> list[list[int]]:
    """Cells in order of decreasing expectation fill a bin until it expects >= 5; a short last bin
    joins the one before. Worked example: expected 30, 20, 4, 3, 2, 1 -> {30}, {20}, {4, 3}, {2, 1}."""
    order = sorted(range(len(expected)), key=lambda i: -expected[i])
    found: list[list[int]] = []
    filled = 0.0
    for i in order:
        if not found or filled >= 5:
            found.append([])
            filled = 0.0
        found[-1].append(i)
        filled += expected[i]
    if len(found) > 1 and filled < 5:
        found[-2].extend(found.pop())
    return found


def binned_chi_square(observed: Sequence[float], expected: Sequence[float]) -> float:
    """Pearson's chi-square p-value of observed counts against expected counts (same total), over
    `bins` of the expectations (never of the observed counts); fewer than two bins -> p = 1."""
    cells = bins(expected)
    if len(cells) < 2:
        return 1.0
    obs = [sum(observed[i] for i in b) for b in cells]
    exp = [sum(expected[i] for i in b) for b in cells]
    exp = [e * sum(obs) / sum(exp) for e in exp]  # rounding only: both totals are n
    return float(chisquare(obs, exp).pvalue)


def chi_square_p(counts: Counter, law: dict[tuple[int, ...], float], n: int) -> float:
    """p-value of `counts` (n draws of token tuples) against `law`; a draw the law gives probability
    0 is an AssertionError naming it."""
    if not set(counts) <= set(law):
        raise AssertionError(f"sampled {sorted(set(counts) - set(law))[:3]}, which the target gives probability 0")
    cells = sorted(law, key=lambda c: (-law[c], c))
    return binned_chi_square([counts[c] for c in cells], [law[c] * n for c in cells])


# ---- the exact law and EOS ------------------------------------------------------------------------


def reference_law(logits: Sequence[float], sampling: SamplingConfig) -> list[float]:
    """The target law of one row of logits, written apart from `target_probs_from_logits` (which the loop runs, and a
    certificate must not take as its own oracle): greedy = one-hot of the first maximum; else softmax(z / T) over the
    tokens at or above the k-th largest z (top-k), then the smallest prefix of the tokens sorted by probability, ties in
    index order, whose mass reaches top_p (top-p), renormalised."""
    v = len(logits)
    if sampling.greedy:
        first = max(range(v), key=lambda i: (logits[i], -i))
        return [float(i == first) for i in range(v)]
    top = max(logits)
    z = [0.0 if x == top else (x - top) / sampling.temperature for x in logits]
    kth = sorted(z, reverse=True)[sampling.top_k - 1] if 0 < sampling.top_k < v else -math.inf
    weights = [math.exp(x) if x >= kth else 0.0 for x in z]
    probs = [w / sum(weights) for w in weights]
    if sampling.top_p < 1.0:
        kept, mass = set(), 0.0
        for i in sorted(range(v), key=lambda i: -probs[i]):  # stable: ties in index order
            if mass >= sampling.top_p:
                break
            kept.add(i)
            mass += probs[i]
        probs = [probs[i] / mass if i in kept else 0.0 for i in range(v)]
    return probs


def exact_law(target: Target, prompt: Sequence[int], sampling: SamplingConfig, eos: set[int] = frozenset(),
              length: int = LENGTH, tilt: float = 0.0) -> dict[tuple[int, ...], float]:
    """The target's exact law of the first `length` generated tokens, cut after the first EOS: each
    token's law from a cacheless forward of the plain model (`next_token_logits`) and `reference_law`
    (`tilt` > 0: that law with `tilt` of its mass moved from its likeliest token to its least likely,
    per-token TV `tilt`: the planted perturbation of `specdec.certify.power.detectable_tv`)."""
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, p in frontier.items():
            if eos.intersection(prefix):
                grown[prefix] = p
                continue
            probs = reference_law(next_token_logits(target, [*prompt, *prefix]).double().tolist(), sampling)
            if tilt:
                probs[probs.index(max(probs))] -= tilt
                probs[probs.index(min(probs))] += tilt
            grown.update({(*prefix, t): p * q for t, q in enumerate(probs) if q > 0})
        frontier = grown
    return frontier


def pick_eos(target: Target, prompt: Sequence[int], sampling: SamplingConfig, length: int = LENGTH) -> int:
    """The token whose first occurrence in `length` tokens is closest to a fair coin: EOS then stops
    about half of the generations early, so both stopped and unstopped paths are tested."""
    law = exact_law(target, prompt, sampling, length=length)
    hit = {t: sum(p for seq, p in law.items() if t in seq) for t in range(target.vocab_size)}
    return min(hit, key=lambda t: abs(hit[t] - 0.5))


# ---- the draft checks -------------------------------------------------------------------------------


class DraftProblem(ValueError):
    """A draft breaks the drafter contract (shape, draft_probs)."""


def shape_limits(shape) -> tuple[int, int]:
    """(most nodes, deepest depth) a draft of concrete `shape` may have."""
    if not isinstance(shape, (ChainShape, TreeShape, DynamicShape)):
        raise DraftProblem(f"the loop asked for {shape!r}, which is not a concrete shape")
    return shape.max_nodes, shape.depth


class Recorder:
    """A drafter wrapper that checks every draft (raising `DraftProblem`) and records, per depth,
    the rank of each sampled token in its recorded distribution (rank 0 = most likely)."""

    def __init__(self, drafter: Drafter, vocab_size: int) -> None:
        self.drafter, self.vocab_size, self.name = drafter, vocab_size, drafter.name
        self.observed: dict[int, list[float]] = defaultdict(lambda: [0.0] * vocab_size)  # depth -> per rank
        self.expected: dict[int, list[float]] = defaultdict(lambda: [0.0] * vocab_size)
        self.steps = 0
        self.branched = 0  # drafts with a node of two or more children (a real tree)

    def __getattr__(self, attr):  # what the loop or a policy reads of the drafter itself
        if attr == "drafter":
            raise AttributeError(attr)
        return getattr(self.drafter, attr)

    def reset(self) -> None:
        self.drafter.reset()
        self.steps = 0

    def commit(self, step: Step) -> None:
        self.drafter.commit(step)

    def propose(self, request: DraftRequest) -> Draft:
        draft = self.drafter.propose(request)
        self.check(request, draft)
        self.steps += 1
        return draft

    def check(self, request: DraftRequest, draft: Draft) -> None:
        """Raise `DraftProblem` for a draft that breaks the contract; record its sampled nodes."""
        n, tokens = draft.num_nodes, draft.tokens[0].tolist()
        self.branched += any(len(kids) > 1 for kids in tree_ops.children(draft.parents))
        most, deepest = shape_limits(request.shape)
        if n > most or draft.depth > deepest:
            raise DraftProblem(f"asked for {request.shape}, the drafter returned {n} nodes of depth {draft.depth}")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise DraftProblem(f"draft tokens {tokens} fall outside the vocabulary 0..{self.vocab_size - 1}")
        if draft.draft_probs is None:
            return  # point-mass: exact for any tokens, however the drafter chose them
        probs = draft.draft_probs.detach().double().cpu()
        if tuple(probs.shape) != (1, n, self.vocab_size):
            raise DraftProblem(f"draft_probs has shape {tuple(probs.shape)}, expected [B, N, V] = [1, {n}, "
                               f"{self.vocab_size}]")
        sums = probs[0].sum(-1)
        for i in range(n):
            if bool((probs[0, i] < 0).any()) or not abs(float(sums[i]) - 1.0) <= SUM_TOLERANCE:
                raise DraftProblem(f"draft_probs of node {i} sum to {float(sums[i]):.6g} (min entry "
                                   f"{float(probs[0, i].min()):.3g}): each row must be a distribution")
            if not float(probs[0, i, tokens[i]]) > 0:
                raise DraftProblem(f"node {i} proposes token {tokens[i]}, whose recorded draft probability is 0")
        for i, d in enumerate(tree_ops.depths(draft.parents).tolist()):
            row = probs[0, i]
            order = sorted(range(self.vocab_size), key=lambda t: (-float(row[t]), t))
            self.observed[d][order.index(tokens[i])] += 1
            for rank, t in enumerate(order):
                self.expected[d][rank] += float(row[t])

    def draft_probability_p(self) -> float | None:
        """min over depths of the chi-square p-value of the sampled tokens' ranks against the recorded
        draft_probs (conservative: the ranks' expected counts sum rows that differ between draws);
        None when nothing was sampled."""
        ps = [binned_chi_square(self.observed[d], self.expected[d]) for d in sorted(self.observed)]
        return min(ps) if ps else None


# ---- the greedy identity -----------------------------------------------------------------------


def greedy_case(target: Target, drafter: Drafter, shape: str, prompts: Sequence[Sequence[int]] = GREEDY_PROMPTS,
                max_new_tokens: int = 20, cache: str = "dynamic", buckets: Sequence[int] | None = None) -> str | None:
    """None when the drafter's greedy output, run on `cache` (at width `buckets`), equals the reference on
    every prompt, else what diverged (or what the drafter raised)."""
    for prompt in prompts:
        ref = reference_generate(target, prompt, max_new_tokens=max_new_tokens, stop_on_eos=False)
        try:
            out = specdec.generate(target, drafter, list(prompt), shape=shape, max_new_tokens=max_new_tokens,
                                   stop_on_eos=False, cache=cache, buckets=buckets).token_ids
        except Exception as err:  # noqa: BLE001 -- a drafter's error fails this case, named
            return f"{target.model.config.model_type} {shape} prompt {list(prompt)}: {type(err).__name__}: {err}"
        if out != ref:
            first = next(i for i, (a, b) in enumerate(zip(out + [None] * len(ref), ref)) if a != b)
            return f"{target.model.config.model_type} {shape} prompt {list(prompt)}: token {first} differs"
    return None


# ---- a distribution case ------------------------------------------------------------------------


@dataclass
class CaseResult:
    """One distribution case of a certificate."""

    shape: str
    sampling: str
    eos: bool
    n: int
    p_value: float
    """Chi-square p of the generated tokens against the exact law (0 when the case failed to run)."""
    draft_p: float | None = None
    """Chi-square p of the sampled draft tokens against their recorded draft_probs (None: no sampled node)."""
    problem: str | None = None
    """Why the case could not run or a draft broke the contract (the case fails)."""
    cache: str = "dynamic"
    prompt: str = "sample"
    drafted: int = 0
    """Draft nodes proposed over all n generations."""
    accepted: int = 0
    """Draft tokens accepted over all n generations."""
    rejections: int = 0
    """Steps that ended in a recovered (not bonus) token after a non-empty draft."""
    branched: int = 0
    """Proposed drafts with a node of two or more children (a real tree)."""
    steps: int = 0

    def count(self, steps) -> None:
        """Add one generation's steps (`StepRecord`s) to the counts."""
        for s in steps:
            self.steps += 1
            self.drafted += s.drafted
            self.accepted += s.accepted
            self.rejections += bool(s.drafted) and not s.bonus

    @property
    def min_p(self) -> float:
        return 0.0 if self.problem else min(self.p_value, 1.0 if self.draft_p is None else self.draft_p)

    @property
    def label(self) -> str:
        cache = "" if self.cache == "dynamic" else f" [{self.cache}]"
        prompt = "" if self.prompt == "sample" else f" ({self.prompt})"
        return f"{self.shape}{cache} {self.sampling}{' eos' if self.eos else ''}{prompt}"

    def row(self) -> dict:
        return {"shape": self.shape, "sampling": self.sampling + (" eos" if self.eos else ""), "n": self.n,
                "p_value": self.p_value, "draft_p": self.draft_p, "cache": self.cache, "prompt": self.prompt,
                "problem": self.problem}


def distribution_case(target: Target, drafter: Drafter, shape: str | ShapeSpec, sampling_name: str, n: int,
                      eos: bool = False, prompt: Sequence[int] = SAMPLE_PROMPT, length: int = LENGTH,
                      cache: str = "dynamic", prompt_name: str = "sample", buckets: Sequence[int] | None = None
                      ) -> CaseResult:
    """Sample n seeded generations of `length` tokens and test them against the target's exact law.
    A case that raises (a bad draft, a shape the drafter cannot make) is a failed case naming why."""
    sampling = SAMPLINGS[sampling_name]
    label = "auto" if isinstance(shape, AutoShape) else str(shape)
    result = CaseResult(label, sampling_name, eos, n, 0.0, cache=cache, prompt=prompt_name)
    recorder = Recorder(drafter, target.vocab_size)
    try:
        stop = pick_eos(target, prompt, sampling, length) if eos else None
        counts: Counter = Counter()
        for seed in range(n):
            out = specdec.generate(target, recorder, list(prompt), shape=shape, max_new_tokens=length,
                                   temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                   seed=seed, stop_on_eos=eos, eos={stop} if eos else None, cache=cache,
                                   buckets=buckets)
            counts[tuple(out.token_ids)] += 1
            result.count(out.stats.steps)
        result.branched = recorder.branched
        result.p_value = chi_square_p(counts, exact_law(target, prompt, sampling, {stop} if eos else set(), length), n)
        result.draft_p = recorder.draft_probability_p()
    except Exception as err:  # noqa: BLE001 -- any error of the drafter or the loop fails this case, named
        result.problem = f"{type(err).__name__}: {err}"
    return result
