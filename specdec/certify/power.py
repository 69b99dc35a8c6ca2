"""The power section of an exactness certificate: reference cases under every mutant, and the
smallest perturbation of the target law the certificate detects.

Owns `REFERENCE_CASES` / `reference_cases` (drafter-independent cases the mutants must fail), the thresholds `ALPHA`
(a case passes at p >= ALPHA) and `POWER_ALPHA` (a mutant is caught at p <= POWER_ALPHA), `power` / `Power` (the
control and each mutant under the reference case it names) and `detectable_tv`: the smallest per-token TV from the
target law a distribution case detects with power >= `POWER` at ALPHA, planted through the real verifier (`tilted`).
Knows nothing about the drafter being certified: `specdec.certify` runs this on `specdec.certify.world`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from scipy.stats import chi2, ncx2

from specdec.certify.batch import batch_case
from specdec.certify.cases import (
    LENGTH,
    SAMPLE_PROMPT,
    SAMPLINGS,
    CaseResult,
    bins,
    distribution_case,
    exact_law,
    greedy_case,
)
from specdec.certify.drafters import ShiftedDrafter, SiblingDrafter
from specdec.certify.mutants import MUTANTS, Mutant, MutantDoesNotApply, mutated
from specdec.certify.world import World
from specdec.drafters.registry import build
from specdec.runtime.model import Target

ALPHA = 1e-4
"""A case passes when its chi-square p-value is >= ALPHA."""
POWER_ALPHA = 1e-6
"""A mutant counts as caught when its p-value is <= POWER_ALPHA."""
POWER_N = 600
"""Generations per reference case."""
POWER = 0.99
"""The detection probability `detectable_tv` is stated at."""


REFERENCE_CASES = ("point-mass siblings", "greedy siblings", "sampled siblings", "shifted chain", "batch rows")


def reference_cases(world: World, n: int = POWER_N, names: Sequence[str] = REFERENCE_CASES) -> list[CaseResult]:
    """The drafter-independent cases the mutants must fail (`names` picks some):
    - point-mass siblings at the flat target's three likeliest tokens (`tree(3)`, 2 tokens);
    - greedy siblings: the greedy target's three likeliest tokens in an order fixed per context (`tree(3,3)`), each
      prompt token for token the reference's (p = 1, or 0), so a later sibling's position and cache entry count;
    - sampled siblings drawn without replacement from a peaky draft unrelated to the target (`tree(3)`);
    - a sampled chain of `ShiftedDrafter` through the real grower under top-k and top-p (T != 1);
    - batch rows: `random` drafts in batches of three prompts of different lengths (n / 3 batches)."""
    unknown = sorted(set(names) - set(REFERENCE_CASES))
    if unknown:
        raise ValueError(f"unknown reference cases {unknown}; known: {', '.join(REFERENCE_CASES)}")
    flat, target = world.flat_target, world.target
    vocab = target.vocab_size
    cases = []
    if "point-mass siblings" in names:
        point_mass = SiblingDrafter(vocab, width=3, depth=1, like=flat, noise=0.0, point_mass=True)
        cases.append(distribution_case(flat, point_mass, "tree(3)", "plain", n, length=2,
                                       prompt_name="point-mass siblings"))
    if "greedy siblings" in names:
        greedy = world.greedy_targets[0]
        shuffled = SiblingDrafter(greedy.vocab_size, width=3, depth=2, like=greedy, noise=0.0, point_mass=True,
                                  shuffle=True)
        why = greedy_case(greedy, shuffled, "tree(3,3)")
        cases.append(CaseResult("tree(3,3)", "greedy", False, 1, float(why is None), problem=why,
                                prompt="greedy siblings"))
    if "sampled siblings" in names:
        sampled = SiblingDrafter(vocab, width=3, depth=1, noise=4.0)
        cases.append(distribution_case(flat, sampled, "tree(3)", "plain", n, length=2, prompt_name="sampled siblings"))
    if "shifted chain" in names:
        cases += [distribution_case(target, ShiftedDrafter(target=target), "chain(2)", sampling, n,
                                    prompt_name="shifted chain") for sampling in ("top-k", "top-p")]
    if "batch rows" in names:
        cases.append(batch_case(target, build("random", target=target), "tree(2,2)", "plain", max(1, n // 3)))
    return cases


@dataclass
class Power:
    """The reference cases unmutated (the control) and under each mutant."""

    control: list[CaseResult]
    mutants: dict[str, list[CaseResult]]
    errors: dict[str, str] = field(default_factory=dict)
    """mutant -> why it could not be applied (the certificate fails)."""
    seconds: float = 0.0
    """CPU seconds (process time) of the control and all mutants."""
    detectable_tv: float = math.nan
    """The smallest per-token TV a distribution case of the certificate's n detects with power >= POWER
    (inf, null in JSON: not even 1 / V; NaN: not computed)."""
    planted_p: float = math.nan
    """p of a `random` chain(2) case of n generations with the law tilted by `detectable_tv` through the
    real verifier (`tilted`): below ALPHA unless the 1 - POWER chance of a miss came up."""

    @property
    def control_p(self) -> float:
        return min(c.min_p for c in self.control)

    def mutant_p(self, name: str) -> float:
        """min p over the reference cases under mutant `name` (NaN: it could not be applied)."""
        return math.nan if name in self.errors else min(c.min_p for c in self.mutants[name])

    @property
    def passed(self) -> bool:
        return self.failure() is None

    def failure(self) -> str | None:
        """The first control case that failed or mutant not caught, with its own p; None: passed."""
        worst = min(self.control, key=lambda c: c.min_p)
        if worst.min_p < ALPHA:
            return f"power control {worst.label!r}: {worst.problem or 'chi-square'} (p = {worst.min_p:.3g} < {ALPHA:g})"
        for m in MUTANTS:
            p = self.mutant_p(m.name)
            if not p <= POWER_ALPHA:
                return self.errors.get(m.name) or f"mutant {m.name!r} not caught (p = {p:.3g} > {POWER_ALPHA:g})"
        return None

    def lines(self) -> list[str]:
        """The power section of a certificate's text."""
        lines = [f"Power (reference cases, unmutated and each mutant edited into the real code under the case it "
                 f"names; caught at p <= {POWER_ALPHA:g}):",
                 f"  {'control':<34} {'all cases':<20} p = {self.control_p:.2e}  "
                 f"{'pass' if self.control_p >= ALPHA else 'FAILED'}"]
        for m in MUTANTS:
            p = self.mutant_p(m.name)
            verdict = self.errors.get(m.name) or ("caught" if p <= POWER_ALPHA else "NOT CAUGHT")
            lines.append(f"  {m.name:<34} {m.case:<20} p = {p:.2e}  {verdict}")
        lines.append(f"  detectable TV: a distribution case detects the target law moved by {self.detectable_tv:.3g} "
                     f"per token (toward its least likely token) with power {POWER:g} at p < {ALPHA:g}; planted "
                     f"through the real verifier: p = {self.planted_p:.2e}")
        return lines

    def json(self) -> dict:
        return {"control": self.control_p, "mutants": {m.name: self.mutant_p(m.name) for m in MUTANTS},
                "detectable_tv": self.detectable_tv if math.isfinite(self.detectable_tv) else None,
                "planted_p": self.planted_p if math.isfinite(self.planted_p) else None}


def power(world: World, n: int = POWER_N, case_n: int = 250) -> Power:
    """Run the reference cases unmutated, then each mutant of the real code under its reference case;
    state `detectable_tv` for distribution cases of `case_n` generations."""
    start = time.process_time()
    result = Power(reference_cases(world, n), {})
    for m in MUTANTS:
        try:
            with mutated(m):
                result.mutants[m.name] = reference_cases(world, n, (m.case,))
        except MutantDoesNotApply as err:
            result.errors[m.name] = str(err)
    result.detectable_tv = detectable_tv(world.target, case_n)
    if math.isfinite(result.detectable_tv):  # the claim checked once through the real verifier
        with mutated(tilted(result.detectable_tv)):
            result.planted_p = distribution_case(world.target, build("random", target=world.target), "chain(2)",
                                                 "plain", case_n, prompt_name="planted tilt").min_p
    result.seconds = time.process_time() - start
    return result


# ---- the smallest perturbation detected ---------------------------------------------------------------


def tilted(tv: float) -> Mutant:
    """The planted perturbation: the verifier's target law with `tv` of its mass moved from its
    likeliest token to its least likely (per-token TV exactly `tv`), an edit of the real `accept`."""
    one_hot = "torch.nn.functional.one_hot"
    return Mutant(f"tilt {tv:g}", "specdec.core.acceptance", "accept",
                  "target_probs_from_logits(target_logits[0], sampling)",
                  f"(lambda p: p + {tv!r} * ({one_hot}(p.argmin(-1), p.shape[-1]) - {one_hot}(p.argmax(-1), "
                  f"p.shape[-1])))(target_probs_from_logits(target_logits[0], sampling))",
                  f"the target law moved by TV {tv:g} per token")


def case_power(target: Target, tv: float, n: int, prompt: Sequence[int] = SAMPLE_PROMPT,
               sampling: str = "plain") -> float:
    """Probability that a distribution case of n generations (its chi-square at ALPHA over its
    bins) detects the law tilted by `tv` per token: noncentral chi-square, noncentrality
    n sum_bins (tilted - exact)^2 / exact."""
    exact = exact_law(target, prompt, SAMPLINGS[sampling], length=LENGTH)
    moved = exact_law(target, prompt, SAMPLINGS[sampling], length=LENGTH, tilt=tv)
    cells = sorted(set(exact) | set(moved), key=lambda c: (-exact.get(c, 0.0), c))
    groups = bins([exact.get(c, 0.0) * n for c in cells])
    if len(groups) < 2:
        return 0.0
    p = [sum(exact.get(cells[i], 0.0) for i in g) for g in groups]
    q = [sum(moved.get(cells[i], 0.0) for i in g) for g in groups]
    shift = n * sum((b - a) ** 2 / a for a, b in zip(p, q))
    return float(ncx2.sf(chi2.isf(ALPHA, len(groups) - 1), len(groups) - 1, shift))


def detectable_tv(target: Target, n: int, steps: int = 12) -> float:
    """The smallest per-token TV (bisection over [0, 1 / V], where the likeliest token always has the
    mass to move) that one distribution case of n generations detects with probability >= POWER at ALPHA."""
    low, high = 0.0, 1.0 / target.vocab_size
    if case_power(target, high, n) < POWER:
        return math.inf
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (low, mid) if case_power(target, mid, n) >= POWER else (mid, high)
    return high
