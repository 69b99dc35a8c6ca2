"""The power section of an exactness certificate: the reference cases, unmutated and under every mutant.

Owns `REFERENCE_CASES` / `reference_cases` (drafter-independent cases every mutant must fail), the
thresholds `ALPHA` (a case passes at p >= ALPHA) and `POWER_ALPHA` (a mutant is caught at
p <= POWER_ALPHA), and `power` / `Power`: the reference cases run unmutated (the control) and under
each mutant of `specdec.measure.mutants` (each one edit of the real acceptance code or draft sampler).
Knows nothing about the drafter being certified: `specdec.certify` runs this once per certificate
(or alone, `--self-test`) and supplies the world of tiny models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.drafters.registry import build
from specdec.measure.certify_cases import CaseResult, SiblingDrafter, distribution_case
from specdec.measure.mutants import MUTANTS, MutantDoesNotApply, mutated

if TYPE_CHECKING:
    from specdec.certify import World

ALPHA = 1e-4
"""A case passes when its chi-square p-value is >= ALPHA."""
POWER_ALPHA = 1e-6
"""A mutant counts as caught when its p-value is <= POWER_ALPHA."""

POWER_N = 600
"""Generations per reference case."""


REFERENCE_CASES = ("point-mass siblings", "sampled siblings", "random chain")


def reference_cases(world: World, n: int = POWER_N, names: Sequence[str] = REFERENCE_CASES) -> list[CaseResult]:
    """The drafter-independent cases every mutant must fail:
    - point-mass siblings at the flat target's three most likely tokens (`tree(3)`, 2 tokens): the
      first sibling is rejected about 3 times in 4, and every wrong walk moves the first token's law;
    - sampled siblings drawn without replacement with their draft probabilities, from a peaky draft
      unrelated to the target (`tree(3)`, logits 4 x N(0, 1)): the first sibling is rejected often,
      and a later sibling's conditional draft distribution differs most from the first's;
    - a sampled chain of the `random` drafter through the real grower under top-k and top-p (its
      recorded draft_probs are what the draft-probability check compares its samples with).
    `names` picks some of them (`REFERENCE_CASES`)."""
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
    if "sampled siblings" in names:
        sampled = SiblingDrafter(vocab, width=3, depth=1, noise=4.0)
        cases.append(distribution_case(flat, sampled, "tree(3)", "plain", n, length=2, prompt_name="sampled siblings"))
    if "random chain" in names:
        chain = build("random", target=target)
        cases += [distribution_case(target, chain, "chain(2)", sampling, n, prompt_name="random chain")
                  for sampling in ("top-k", "top-p")]
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

    @property
    def control_p(self) -> float:
        return min(c.min_p for c in self.control)

    def mutant_p(self, name: str) -> float:
        """min p over the reference cases under mutant `name` (NaN: it could not be applied)."""
        return math.nan if name in self.errors else min(c.min_p for c in self.mutants[name])

    @property
    def passed(self) -> bool:
        return self.control_p >= ALPHA and all(self.mutant_p(m.name) <= POWER_ALPHA for m in MUTANTS)

    def json(self) -> dict:
        return {"control": self.control_p, "mutants": {m.name: self.mutant_p(m.name) for m in MUTANTS}}


def power(world: World, n: int = POWER_N) -> Power:
    """Run the reference cases unmutated, then under each mutant of the real code."""
    start = time.process_time()
    result = Power(reference_cases(world, n), {})
    for m in MUTANTS:
        try:
            with mutated(m):
                result.mutants[m.name] = reference_cases(world, n)
        except MutantDoesNotApply as err:
            result.errors[m.name] = str(err)
    result.seconds = time.process_time() - start
    return result
