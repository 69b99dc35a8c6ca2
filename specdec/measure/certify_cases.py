"""The statistical cases of an exactness certificate, and the checks run on every draft.

Owns:
- `chi_square_p` / `binned_chi_square`: Pearson's chi-square with cells binned by the expected
  counts (never by the observed ones);
- `exact_law`, `pick_eos`, `eos_token`: the target's exact law of the first few tokens, and EOS
  stopping for a case;
- `distribution_case`: n seeded generations through `specdec.generate` (any shape, `auto`
  included, and any cache) tested against the exact law; the drafter runs inside a `Recorder`;
- `Recorder`: wraps a drafter and checks each draft it proposes: `draft_probs` of shape [B, N, V]
  with rows that sum to 1 and give every proposed token mass (a sampled token whose probability is
  missing), and a draft that fits the requested shape. It also tests, per depth, that the tokens
  sampled match the recorded `draft_probs` (`draft_probability_p`). A draft without `draft_probs`
  is point-mass, which the verifier handles exactly whatever chose its tokens (a sampled draft
  recorded as point-mass is exact too, only accepted less often);
- `SiblingDrafter`: a synthetic drafter whose sampled siblings carry draft probabilities.
Knows nothing about particular registered drafters or about mutants.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from scipy.stats import chisquare

import specdec
from specdec.core import tree as tree_ops
from specdec.core.draft import Draft, Drafter, DraftRequest, Step
from specdec.loop.reference import exact_joint_probs, next_token_logits
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import AutoShape, ChainShape, DynamicShape, ShapeSpec, TreeShape
from specdec.runtime.model import Target

LENGTH = 3
"""Tokens per generation compared with the exact law (the joint of the first LENGTH tokens)."""
SAMPLINGS = {
    "plain": SamplingConfig(temperature=1.0),
    "top-k": SamplingConfig(temperature=0.8, top_k=3),
    "top-p": SamplingConfig(temperature=1.0, top_p=0.8),
}
SAMPLE_PROMPT = (1, 2, 3, 1, 2)
"""Prompt of the T > 0 cases; its repeats give prompt-lookup drafters something to propose."""
SUM_TOLERANCE = 1e-4
"""How far from 1 a row of `draft_probs` may sum."""


# ---- chi-square ----------------------------------------------------------------------------------


def binned_chi_square(observed: Sequence[float], expected: Sequence[float]) -> float:
    """Pearson's chi-square p-value of observed counts against expected counts (same total).

    Cells in order of decreasing expectation fill a bin until it expects >= 5; a short last bin joins
    the one before. The bins depend on the expectations only. Worked example: expected 30, 20, 4, 3,
    2, 1 -> bins {30}, {20}, {4, 3}, {2, 1}; fewer than two bins -> p = 1."""
    order = sorted(range(len(expected)), key=lambda i: -expected[i])
    bins: list[list[int]] = []
    filled = 0.0
    for i in order:
        if not bins or filled >= 5:
            bins.append([])
            filled = 0.0
        bins[-1].append(i)
        filled += expected[i]
    if len(bins) > 1 and filled < 5:
        bins[-2].extend(bins.pop())
    if len(bins) < 2:
        return 1.0
    obs = [sum(observed[i] for i in b) for b in bins]
    exp = [sum(expected[i] for i in b) for b in bins]
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


def cut_at_eos(tokens: Sequence[int], eos: set[int]) -> tuple[int, ...]:
    """The tokens up to and including the first EOS (all of them if none)."""
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tuple(tokens if stop is None else tokens[: stop + 1])


def exact_law(target: Target, prompt: Sequence[int], sampling: SamplingConfig,
              eos: set[int] = frozenset(), length: int = LENGTH) -> dict[tuple[int, ...], float]:
    """The target's exact law of the first `length` generated tokens, cut after the first EOS."""
    law: Counter = Counter()
    for seq, p in exact_joint_probs(target, list(prompt), length, sampling).items():
        law[cut_at_eos(seq, eos)] += p
    return dict(law)


def pick_eos(target: Target, prompt: Sequence[int], sampling: SamplingConfig, length: int = LENGTH) -> int:
    """The token whose first occurrence in `length` tokens is closest to a fair coin: EOS then stops
    about half of the generations early, so both stopped and unstopped paths are tested."""
    law = exact_joint_probs(target, list(prompt), length, sampling)
    hit = {t: sum(p for seq, p in law.items() if t in seq) for t in range(target.vocab_size)}
    return min(hit, key=lambda t: abs(hit[t] - 0.5))


@contextmanager
def eos_token(target: Target, token: int | None) -> Iterator[None]:
    """Make `token` the target's only EOS for the duration (None: no EOS)."""
    config = target.model.generation_config
    saved, model_saved = config.eos_token_id, getattr(target.model.config, "eos_token_id", None)
    config.eos_token_id = token
    target.model.config.eos_token_id = None
    try:
        yield
    finally:
        config.eos_token_id = saved
        target.model.config.eos_token_id = model_saved


# ---- the draft checks -------------------------------------------------------------------------------


class DraftProblem(ValueError):
    """A draft breaks the drafter contract (shape, draft_probs)."""


def shape_limits(shape) -> tuple[int, int]:
    """(most nodes, deepest depth) a draft of concrete `shape` may have."""
    if isinstance(shape, ChainShape):
        return shape.k, shape.k
    if isinstance(shape, TreeShape):
        return shape.max_nodes, len(shape.widths)
    if isinstance(shape, DynamicShape):
        return shape.budget, shape.depth
    raise DraftProblem(f"the loop asked for {shape!r}, which is not a concrete shape")


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
                      cache: str = "dynamic", prompt_name: str = "sample") -> CaseResult:
    """Sample n seeded generations of `length` tokens and test them against the target's exact law.
    A case that raises (a bad draft, a shape the drafter cannot make) is a failed case naming why."""
    sampling = SAMPLINGS[sampling_name]
    label = "auto" if isinstance(shape, AutoShape) else str(shape)
    result = CaseResult(label, sampling_name, eos, n, 0.0, cache=cache, prompt=prompt_name)
    recorder = Recorder(drafter, target.vocab_size)
    try:
        stop = pick_eos(target, prompt, sampling, length) if eos else None
        counts: Counter = Counter()
        with eos_token(target, stop):
            for seed in range(n):
                out = specdec.generate(target, recorder, list(prompt), shape=shape, max_new_tokens=length,
                                       temperature=sampling.temperature, top_k=sampling.top_k,
                                       top_p=sampling.top_p, seed=seed, stop_on_eos=eos, cache=cache)
                counts[tuple(out.token_ids)] += 1
                for s in out.stats.steps:
                    result.steps += 1
                    result.drafted += s.drafted
                    result.accepted += s.accepted
                    result.rejections += bool(s.drafted) and not s.bonus
        result.branched = recorder.branched
        result.p_value = chi_square_p(counts, exact_law(target, prompt, sampling, {stop} if eos else set(), length), n)
        result.draft_p = recorder.draft_probability_p()
    except Exception as err:  # noqa: BLE001 -- any error of the drafter or the loop fails this case, named
        result.problem = f"{type(err).__name__}: {err}"
    return result


# ---- a synthetic drafter with sampled siblings ---------------------------------------------------


class SiblingDrafter:
    """Synthetic drafter: every node gets `width` sampled siblings up to `depth`, each with its draft
    probabilities recorded, i.i.d. (`replace=True`) or without replacement (each sibling's recorded
    distribution is the conditional one given the earlier siblings, renormalised); or, with
    `point_mass=True`, its top-`width` tokens as deterministic siblings without draft probabilities.

    Its distribution after a context is softmax(sharpen x `like`'s logits + noise x N(0, 1)), the
    noise seeded by the context (so it is a fixed function of the context); without `like`, pure
    noise. A `like` target sharpened (sharpen > 1) gives the peaky mismatch that makes a case reject
    often: the draft piles its mass on the target's favourite token, is rejected there about as
    often as the target doubts it, and the next sibling then meets a heavily reshaped residual."""

    name = "siblings"

    def __init__(self, vocab_size: int, *, width: int = 2, depth: int = 2, replace: bool = False,
                 like: Target | None = None, sharpen: float = 1.0, noise: float = 1.0, seed: int = 0,
                 point_mass: bool = False) -> None:
        self.vocab_size, self.width, self.depth, self.replace = vocab_size, width, depth, replace
        self.point_mass = point_mass
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
                    for x in q.topk(min(self.width, self.vocab_size)).indices.tolist():
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
