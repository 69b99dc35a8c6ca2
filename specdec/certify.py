"""An exactness certificate for any registered drafter: `python -m specdec.certify DRAFTER`.

Owns the certificate that the test suite and the command line share:
- greedy identity (`greedy_case`): at T = 0 the loop's output equals the cacheless reference's
  greedy output, token for token (fp64 tiny models of three families);
- the drafter's distribution cases (`specdec.measure.certify_cases.distribution_case`): at T > 0,
  Pearson's chi-square of the first `LENGTH` generated tokens of n seeded generations against the
  target's exact law, per shape x {plain, top-k, top-p} x EOS stopping {off, on}; on a second prompt
  whose repeats branch (n-gram trees, more rejections); `auto` at T > 0 and the static and graphs
  caches. Every draft is checked (`Recorder`): it fits the shape asked for, its draft_probs are
  well formed, and the sampled tokens' ranks match the recorded draft_probs per depth (chi-square);
- power (`power`): the reference cases (drafter-independent: point-mass siblings, sampled siblings
  with draft probabilities, a sampled chain under top-k and top-p through the real grower) run
  unmutated (the control) and under every mutant of `specdec.measure.mutants` (each one edit of the
  real acceptance code or draft sampler). A certificate passes only if every case of the drafter and
  the control pass (p >= ALPHA) and every mutant is caught (p <= POWER_ALPHA);
- `certify` and `main`: a readable certificate with one JSON line last, or with
  `--self-test` the power section alone as one JSON line.
Knows nothing about any particular drafter: it builds them by name through the registry, with the
factory's `test_options` under the user's `--options`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import specdec
from specdec.core.draft import Drafter
from specdec.core.reference import reference_generate
from specdec.core.shapes import AutoShape
from specdec.drafters.registry import _REGISTRY as _DRAFTERS
from specdec.drafters.registry import build, parse_options
from specdec.measure.certify_cases import LENGTH, SAMPLINGS, CaseResult, SiblingDrafter, distribution_case
from specdec.measure.latency import LatencyCurve
from specdec.measure.mutants import MUTANTS, MutantDoesNotApply, mutated
from specdec.target.model import Target

VOCAB = 5
"""Vocabulary of the T > 0 models: small enough to enumerate V^LENGTH sequences exactly."""
ALPHA = 1e-4
"""A case passes when its chi-square p-value is >= ALPHA."""
POWER_ALPHA = 1e-6
"""A mutant counts as caught when its p-value is <= POWER_ALPHA."""
DISTRIBUTION_SHAPES = ("chain(2)", "tree(2,2)", "dynamic(top_k=2,depth=2,budget=4)")
GREEDY_SHAPES = ("chain(1)", "chain(4)", "tree(3,2,2)", "dynamic(top_k=3,depth=5,budget=12)")
GREEDY_PROMPTS = ([1, 5, 9, 5, 9, 5, 9, 13], [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 2, 3, 5])
BRANCH_PROMPT = (2, 0, 1, 4, 4, 0, 1, 1, 1, 0)
"""Second T > 0 prompt: its trailing n-grams recur with different continuations (n-gram drafters
grow real trees) and its contexts are ones the tiny draft models disagree on more (more rejections)."""
FAMILIES = ("llama", "qwen2", "mistral")
AUTO_LATENCY = LatencyCurve(target="synthetic", device="cpu", dtype="float64", machine="certificate", threads=1,
                            widths=(1, 2, 4, 8, 16), contexts=(64,), seconds=((1.0, 1.1, 1.2, 1.4, 1.8),))
"""The latency curve of the `auto` cases: cheap width, so auto drafts chains and trees."""
COVERAGE = (("auto", "plain", "dynamic"), ("auto", "top-p", "dynamic"), ("tree(2,2)", "plain", "static"),
            ("chain(2)", "top-k", "static"), ("dynamic(top_k=2,depth=2,budget=4)", "plain", "graphs"),
            ("chain(2)", "top-p", "graphs"))
"""(shape, sampling, cache) of the coverage cases: `auto` at T > 0, the preallocated caches."""


# ---- the models and the drafter ----------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """The tiny models a certificate runs on."""

    greedy_targets: tuple[Target, ...]
    """fp64 targets (vocab 64), one per model family, for the token-exact greedy identity."""
    target: Target
    """fp64 target with a VOCAB-token vocabulary for the distribution tests."""
    draft_model: Target
    """A different fp64 model on the same vocabulary: the `model=` of drafters that take one."""
    flat_target: Target
    """A flatter fp64 VOCAB-token target (logit scale 1.5): the point-mass sibling reference case."""


def tiny_world() -> World:
    """Build the certificate's models (seeded: every run sees the same weights)."""
    greedy = tuple(specdec.tiny_target(f, vocab_size=64, dtype=torch.float64, seed=0, logit_scale=4.0)
                   for f in FAMILIES)
    small = dict(vocab_size=VOCAB, hidden_size=16, dtype=torch.float64)
    return World(greedy, specdec.tiny_target("llama", seed=0, logit_scale=6.0, **small),
                 specdec.tiny_target("llama", seed=7, logit_scale=6.0, **small),
                 specdec.tiny_target("llama", seed=3, logit_scale=1.5, **small))


def build_drafter(name: str, target: Target, options: dict | None = None) -> Drafter:
    """Build `name` for a tiny `target`: its factory's `test_options`, overridden by `options`."""
    if name not in _DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; registered drafters: {', '.join(specdec.drafters.names())}")
    defaults = getattr(_DRAFTERS[name], "test_options", {})
    return build(name, target=target, **{**defaults, **(options or {})})


# ---- T = 0 ----------------------------------------------------------------------------------------


def greedy_case(target: Target, drafter: Drafter, shape: str, prompts: Sequence[Sequence[int]] = GREEDY_PROMPTS,
                max_new_tokens: int = 20) -> str | None:
    """None when the drafter's greedy output equals the reference on every prompt, else what diverged
    (or what the drafter raised)."""
    for prompt in prompts:
        ref = reference_generate(target, prompt, max_new_tokens=max_new_tokens, stop_on_eos=False)
        try:
            out = specdec.generate(target, drafter, list(prompt), shape=shape, max_new_tokens=max_new_tokens,
                                   stop_on_eos=False).token_ids
        except Exception as err:  # noqa: BLE001 -- a drafter's error fails this case, named
            return f"{target.model.config.model_type} {shape} prompt {list(prompt)}: {type(err).__name__}: {err}"
        if out != ref:
            first = next(i for i, (a, b) in enumerate(zip(out + [None] * len(ref), ref)) if a != b)
            return f"{target.model.config.model_type} {shape} prompt {list(prompt)}: token {first} differs"
    return None


# ---- the drafter's cases ----------------------------------------------------------------------------


def parse_case_shape(shape: str):
    """A case's shape: `auto(...)` runs on `AUTO_LATENCY` (no measuring), any other as given."""
    spec = specdec.parse_shape(shape)
    return dataclasses.replace(spec, latency=AUTO_LATENCY) if isinstance(spec, AutoShape) else shape


def drafter_cases(world: World, drafter: Drafter, shapes: Sequence[str], n: int,
                  samplings: Sequence[str] = tuple(SAMPLINGS), eos: Sequence[bool] = (False, True),
                  coverage: bool = True) -> list[CaseResult]:
    """The drafter's distribution cases: shapes x samplings x EOS on the sample prompt, shapes x
    samplings on `BRANCH_PROMPT`, and (coverage) the `COVERAGE` cases."""
    cases = [distribution_case(world.target, drafter, parse_case_shape(shape), sampling, n, stop)
             for shape in shapes for sampling in samplings for stop in eos]
    cases += [distribution_case(world.target, drafter, parse_case_shape(shape), sampling, n, prompt=BRANCH_PROMPT,
                                prompt_name="branch prompt") for shape in shapes for sampling in samplings]
    if coverage:
        cases += [distribution_case(world.target, drafter, parse_case_shape(shape), sampling, n, cache=cache)
                  for shape, sampling, cache in COVERAGE]
    return cases


# ---- power: the reference cases, unmutated and under every mutant -------------------------------

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
    cases = []
    if "point-mass siblings" in names:
        point_mass = SiblingDrafter(VOCAB, width=3, depth=1, like=flat, noise=0.0, point_mass=True)
        cases.append(distribution_case(flat, point_mass, "tree(3)", "plain", n, length=2,
                                       prompt_name="point-mass siblings"))
    if "sampled siblings" in names:
        sampled = SiblingDrafter(VOCAB, width=3, depth=1, noise=4.0)
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


# ---- the certificate ----------------------------------------------------------------------------


@dataclass
class Certificate:
    drafter: str
    options: dict
    greedy: dict[str, str | None] = field(default_factory=dict)
    """shape -> None (identical on every family and prompt) or what diverged."""
    cases: list[CaseResult] = field(default_factory=list)
    power: Power | None = None
    seconds: float = 0.0
    """CPU seconds (process time) of the whole certificate."""

    @property
    def min_p(self) -> float:
        return min((c.min_p for c in self.cases), default=1.0)

    @property
    def passed(self) -> bool:
        return (all(v is None for v in self.greedy.values()) and self.min_p >= ALPHA
                and self.power is not None and self.power.passed)

    def json_line(self) -> str:
        return json.dumps({"drafter": self.drafter, "passed": self.passed, "cases": [c.row() for c in self.cases],
                           "min_p": self.min_p, "power": None if self.power is None else self.power.json(),
                           "cpu_seconds": round(self.seconds, 1)})

    def text(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items()) or "test defaults"
        lines = [f"Exactness certificate: drafter {self.drafter!r} ({opts})", "",
                 f"Greedy identity (T = 0, {len(FAMILIES)} fp64 families x {len(GREEDY_PROMPTS)} prompts x 20 tokens, "
                 "vs the cacheless reference):"]
        lines += [f"  {shape:<40} {'identical' if why is None else 'DIVERGED: ' + why}"
                  for shape, why in self.greedy.items()]
        lines += ["", f"Distribution (T > 0, chi-square of the first {LENGTH} tokens vs the exact law, vocab {VOCAB}; "
                  f"draft p: sampled draft tokens vs their recorded draft_probs; pass at p >= {ALPHA:g}):"]
        lines += _case_table(self.cases)
        if self.power is None:
            lines += ["", "Power: skipped (--power-n 0): no evidence that these cases can fail, so no PASS"]
        else:
            lines += ["", f"Power (reference cases, unmutated and with each mutant edited into the real code; "
                      f"caught at p <= {POWER_ALPHA:g}):"]
            lines += [f"  control{'':<27} p = {self.power.control_p:.2e}  "
                      f"{'pass' if self.power.control_p >= ALPHA else 'FAILED'}"]
            for m in MUTANTS:
                p = self.power.mutant_p(m.name)
                verdict = self.power.errors.get(m.name) or ("caught" if p <= POWER_ALPHA else "NOT CAUGHT")
                lines.append(f"  {m.name:<34} p = {p:.2e}  {verdict}")
        lines += ["", f"{'PASS' if self.passed else 'FAIL'}: min p = {self.min_p:.3g}, {self.seconds:.0f} CPU s"]
        return "\n".join(lines)


def _case_table(cases: Sequence[CaseResult]) -> list[str]:
    lines = [f"  {'case':<58} {'n':>5} {'p':>9} {'draft p':>9}  accepted/drafted  rejected  trees"]
    for c in cases:
        draft_p = "-" if c.draft_p is None else f"{c.draft_p:.3g}"
        lines.append(f"  {c.label:<58} {c.n:>5} {c.p_value:>9.3g} {draft_p:>9}  {c.accepted:>6}/{c.drafted:<9} "
                     f"{c.rejections:>5}/{c.steps:<5} {c.branched:>4}")
        if c.problem:
            lines.append(f"    FAILED: {c.problem}")
    return lines


def certify(name: str, *, shapes: Sequence[str] = DISTRIBUTION_SHAPES, options: dict | None = None,
            n: int = 250, samplings: Sequence[str] = tuple(SAMPLINGS), eos: Sequence[bool] = (False, True),
            power_n: int = POWER_N, greedy_shapes: Sequence[str] | None = None, coverage: bool = True,
            power_result: Power | None = None) -> Certificate:
    """Run the greedy identity, the drafter's distribution cases and the power section for `name`
    (power_n = 0 skips the power section; such a certificate cannot pass). The power section does
    not depend on the drafter: `power_result` reuses one already run (its CPU time is counted)."""
    start = time.process_time()
    world = tiny_world()
    cert = Certificate(name, dict(options or {}))
    for shape in greedy_shapes or GREEDY_SHAPES:
        cert.greedy[shape] = next(filter(None, (greedy_case(t, build_drafter(name, t, options), shape)
                                                for t in world.greedy_targets)), None)
    drafter = build_drafter(name, world.target, options)
    cert.cases = drafter_cases(world, drafter, shapes, n, samplings, eos, coverage)
    cert.power = power_result or (power(world, power_n) if power_n else None)
    cert.seconds = time.process_time() - start + (power_result.seconds if power_result else 0.0)
    return cert


def split_shapes(text: str) -> list[str]:
    """`chain(2);tree(2,2)` or `chain(2) tree(2,2)` -> shape strings (commas live inside shapes)."""
    shapes = [s for s in text.replace(";", " ").split() if s]
    for s in shapes:
        specdec.parse_shape(s)
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.certify", description=__doc__.split("\n")[0])
    parser.add_argument("drafter", nargs="?", help=f"a registered drafter ({', '.join(specdec.drafters.names())})")
    parser.add_argument("--shapes", default=" ".join(DISTRIBUTION_SHAPES),
                        help="draft shapes of the distribution cases, separated by ';' or spaces")
    parser.add_argument("--options", default="", help="drafter options k=v,... (override its test_options)")
    parser.add_argument("-n", type=int, default=250, help="generations per distribution case (default 250)")
    parser.add_argument("--power-n", type=int, default=POWER_N, help="generations per reference case (0 = skip)")
    parser.add_argument("--self-test", action="store_true",
                        help="only the power section: one JSON line {control: p, mutants: {name: p}}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.self_test:
        result = power(tiny_world(), args.power_n or POWER_N)
        for why in result.errors.values():
            print(f"certify: {why}", file=sys.stderr)
        print(json.dumps({**result.json(), "cpu_seconds": round(result.seconds, 1)}))
        return 0 if result.passed else 1
    try:
        if args.drafter is None:
            raise KeyError(f"name a drafter ({', '.join(specdec.drafters.names())}) or pass --self-test")
        shapes = split_shapes(args.shapes)
        options = parse_options(args.options)
        if args.drafter not in specdec.drafters.names():
            raise KeyError(f"unknown drafter {args.drafter!r}; registered: {', '.join(specdec.drafters.names())}")
    except (ValueError, KeyError) as err:
        print(f"certify: {err.args[0]}", file=sys.stderr)
        return 2
    cert = certify(args.drafter, shapes=shapes, options=options, n=args.n, power_n=args.power_n)
    print(cert.text())
    print(cert.json_line())
    return 0 if cert.passed else 1


if __name__ == "__main__":
    sys.exit(main())
