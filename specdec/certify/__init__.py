"""An exactness certificate for any registered drafter: `python -m specdec.certify DRAFTER`.

Owns the certificate that the test suite and the command line share:
- greedy identity (`greedy_case`): at T = 0 the loop's output equals the cacheless reference's, token for token, on
  position-keyed fp64 models (`specdec.certify.world`);
- distribution cases (`cases.distribution_case`): at T > 0, Pearson's chi-square of the first `LENGTH` tokens of n
  seeded generations against the target's exact law, per shape x {plain, top-k, top-p} x EOS {off, on}, caches and
  batched rows (`specdec.certify.batch`: a drafter that cannot batch gets a line saying so, not a failure); every
  draft is checked (`Recorder`);
- power (`specdec.certify.power`): reference cases pass unmutated and fail under every mutant of
  `specdec.certify.mutants`, with the smallest per-token TV detected (`detectable_tv`). A certificate passes only if
  every case and the control pass (p >= ALPHA) and every mutant is caught (p <= POWER_ALPHA); a FAIL names it, with p;
- the width effect (`--target`, `specdec.measure.width_effect`): the promise (`PROMISE`) is exactness with respect to
  the target's computation at the verification width; on a target that is not plain fp32/fp64 the verdict is
  WIDTH-DEPENDENT, not PASS;
- `certify` and `main`: a readable certificate with one JSON line last (`--self-test`: the power section alone).
Knows nothing about any particular drafter: it builds them by name through the registry, with the
factory's `test_options` under the user's `--options`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import specdec
from specdec.certify.batch import batch_case
from specdec.certify.cases import GREEDY_PROMPTS, LENGTH, SAMPLINGS, CaseResult, distribution_case, greedy_case
from specdec.certify.drafters import SiblingDrafter
from specdec.certify.power import ALPHA, POWER_ALPHA, POWER_N, REFERENCE_CASES, Power, power, reference_cases
from specdec.certify.world import FAMILIES, VOCAB, World, tiny_world
from specdec.core.curve import LatencyCurve
from specdec.core.draft import Drafter
from specdec.core.shapes import AutoShape
from specdec.drafters.registry import _REGISTRY as _DRAFTERS
from specdec.drafters.registry import build, parse_options
from specdec.measure import width_effect as widths
from specdec.runtime.model import Target

__all__ = ["ALPHA", "POWER_ALPHA", "POWER_N", "REFERENCE_CASES", "Certificate", "Power", "SiblingDrafter", "World",
           "certify", "main", "power", "reference_cases", "tiny_world"]
DISTRIBUTION_SHAPES = ("chain(2)", "tree(2,2)", "dynamic(top_k=2,depth=2,budget=4)")
GREEDY_SHAPES = ("chain(1)", "chain(4)", "tree(3,2,2)", "dynamic(top_k=3,depth=5,budget=12)")
BRANCH_PROMPT = (2, 0, 1, 4, 4, 0, 1, 1, 1, 0)
"""Second T > 0 prompt: its trailing n-grams recur with different continuations (n-gram drafters
grow real trees) and its contexts are ones the tiny draft models disagree on more (more rejections)."""
AUTO_LATENCY = LatencyCurve(target="synthetic", device="cpu", dtype="float64", machine="certificate", threads=1,
                            widths=(1, 2, 4, 8, 16), contexts=(64,), seconds=((1.0, 1.1, 1.2, 1.4, 1.8),))
"""The latency curve of the `auto` cases: cheap width, so auto drafts chains and trees."""
COVERAGE = (("auto", "plain", "dynamic"), ("auto", "top-p", "dynamic"), ("tree(2,2)", "plain", "static"),
            ("chain(2)", "top-k", "static"), ("dynamic(top_k=2,depth=2,budget=4)", "plain", "graphs"),
            ("chain(2)", "top-p", "graphs"))
"""(shape, sampling, cache) of the coverage cases: `auto` at T > 0, the preallocated caches."""
BATCH_SAMPLINGS = ("greedy", "top-k", "top-p")
"""Samplings of the batched cases, one case per distribution shape and sampling."""
PROMISE = ("exact with respect to the target's computation at the verification width; in bf16/fp16 or "
           "low-bit kernels the target's own law depends on the forward's width")


# ---- the models and the drafter ----------------------------------------------------------------


def build_drafter(name: str, target: Target, options: dict | None = None) -> Drafter:
    """Build `name` for a tiny `target`: its factory's `test_options`, overridden by `options`."""
    if name not in _DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; registered drafters: {', '.join(specdec.drafters.names())}")
    defaults = getattr(_DRAFTERS[name], "test_options", {})
    return build(name, target=target, **{**defaults, **(options or {})})


# ---- the drafter's cases ----------------------------------------------------------------------------


def parse_case_shape(shape: str):
    """A case's shape: `auto(...)` runs on `AUTO_LATENCY` (no measuring), any other as given."""
    spec = specdec.parse_shape(shape)
    return dataclasses.replace(spec, latency=AUTO_LATENCY) if isinstance(spec, AutoShape) else shape


def batch_cases(world: World, drafter: Drafter, n: int, samplings: Sequence[str] = BATCH_SAMPLINGS,
                shapes: Sequence[str] = DISTRIBUTION_SHAPES, greedy_drafter: Drafter | None = None,
                ) -> list[CaseResult] | None:
    """One batched case per shape and sampling (n batches each at T > 0; "greedy" runs
    `greedy_drafter`, built on the first greedy target, and is skipped without one); None when the
    drafter cannot batch."""
    cases = [batch_case(world.greedy_targets[0], greedy_drafter, shape, sampling, n) if sampling == "greedy"
             else batch_case(world.target, drafter, shape, sampling, n)
             for shape in shapes for sampling in samplings if sampling != "greedy" or greedy_drafter is not None]
    return None if any(c is None for c in cases) else cases


def drafter_cases(world: World, drafter: Drafter, shapes: Sequence[str], n: int,
                  samplings: Sequence[str] = tuple(SAMPLINGS), eos: Sequence[bool] = (False, True),
                  coverage: bool = True, cache: str = "dynamic", buckets: Sequence[int] | None = None
                  ) -> list[CaseResult]:
    """The drafter's distribution cases on `cache` (at width `buckets`): shapes x samplings x EOS on the
    sample prompt, shapes x samplings on `BRANCH_PROMPT`, and (coverage) the `COVERAGE` cases."""
    cases = [distribution_case(world.target, drafter, parse_case_shape(shape), sampling, n, stop, cache=cache,
                                buckets=buckets) for shape in shapes for sampling in samplings for stop in eos]
    cases += [distribution_case(world.target, drafter, parse_case_shape(shape), sampling, n, prompt=BRANCH_PROMPT,
                                cache=cache, buckets=buckets, prompt_name="branch prompt") for shape in shapes for sampling in samplings]
    if coverage:
        cases += [distribution_case(world.target, drafter, parse_case_shape(shape), sampling, n, cache=cache)
                  for shape, sampling, cache in COVERAGE]
    return cases


# ---- the certificate ----------------------------------------------------------------------------


@dataclass
class Certificate:
    drafter: str
    options: dict
    greedy: dict[str, str | None] = field(default_factory=dict)
    """shape -> None (identical on every family and prompt) or what diverged."""
    cases: list[CaseResult] = field(default_factory=list)
    batch: list[CaseResult] | None = None
    """The batched cases; None when the drafter cannot batch (not a failure)."""
    power: Power | None = None
    width: widths.WidthEffect | None = None
    """The width effect on a real target (`--target`); None when none was given."""
    seconds: float = 0.0
    """CPU seconds (process time) of the whole certificate."""
    cache: str = "dynamic"
    """What the greedy identity and the drafter's own cases ran on (`generate(cache=...)`)."""

    @property
    def min_p(self) -> float:
        return min((c.min_p for c in [*self.cases, *(self.batch or [])]), default=1.0)

    def failure(self) -> str | None:
        """The first thing that failed, named with its own p; None when the algorithm is exact."""
        why = next(((shape, why) for shape, why in self.greedy.items() if why is not None), None)
        if why is not None:
            return f"greedy identity {why[0]}: {why[1]} (p = 0)"
        worst = min([*self.cases, *(self.batch or [])], key=lambda c: c.min_p, default=None)
        if worst is not None and worst.min_p < ALPHA:
            return f"case {worst.label!r}: {worst.problem or 'chi-square'} (p = {worst.min_p:.3g} < {ALPHA:g})"
        return "no power section (--power-n 0)" if self.power is None else self.power.failure()

    @property
    def exact(self) -> bool:
        """The algorithm is exact: greedy identity, every case and the power section pass (fp64 models)."""
        return self.failure() is None

    @property
    def width_dependent(self) -> bool:
        """A real target was measured whose law depends on the forward's width (not plain fp32/fp64)."""
        return self.width is not None and not self.width.exact_arithmetic

    @property
    def verdict(self) -> str:
        """PASS, FAIL, or WIDTH-DEPENDENT: exact algorithm, but the target's law moves with the width."""
        return "FAIL" if not self.exact else "WIDTH-DEPENDENT" if self.width_dependent else "PASS"

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    def json_line(self) -> str:
        return json.dumps({"drafter": self.drafter, "passed": self.passed, "verdict": self.verdict,
                           "cases": [c.row() for c in self.cases],
                           "batch": None if self.batch is None else [c.row() for c in self.batch],
                           "min_p": self.min_p, "power": None if self.power is None else self.power.json(),
                           "detectable_tv": None if self.power is None else self.power.json()["detectable_tv"],
                           "failure": self.failure(),
                           "width": None if self.width is None else self.width.json(), "promise": PROMISE,
                           "cpu_seconds": round(self.seconds, 1)})

    def text(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items()) or "test defaults"
        lines = [f"Exactness certificate: drafter {self.drafter!r} ({opts})", "",
                 f"Greedy identity (T = 0, {len(FAMILIES)} fp64 families x {len(GREEDY_PROMPTS)} prompts x 20 tokens, "
                 f"cache {self.cache!r}, vs the cacheless reference):"]
        lines += [f"  {shape:<40} {'identical' if why is None else 'DIVERGED: ' + why}"
                  for shape, why in self.greedy.items()]
        lines += ["", f"Distribution (T > 0, chi-square of the first {LENGTH} tokens vs the exact law, vocab {VOCAB}; "
                  f"draft p: sampled draft tokens vs their recorded draft_probs; pass at p >= {ALPHA:g}):"]
        lines += _case_table(self.cases)
        if self.batch is None:
            lines += [f"  batches: drafter {self.drafter!r} does not batch (generate_batch refuses it); "
                      "no batched case (not a failure)"]
        else:
            lines += ["  batched (rows of batches of 3 prompts, each against its own prompt's law or greedy reference):"]
            lines += _case_table(self.batch)[1:]
        if self.power is None:
            lines += ["", "Power: skipped (--power-n 0): no evidence that these cases can fail, so no PASS"]
        else:
            lines += ["", *self.power.lines()]
        if self.width is not None:
            lines += ["", *self.width.lines()]
        lines += ["", f"Promise: {PROMISE}."]
        tail = f"min p = {self.min_p:.3g}, {self.seconds:.0f} CPU s"
        if self.power is not None:
            tail = f"min p = {self.min_p:.3g}, detectable TV {self.power.detectable_tv:.3g} per token, {self.seconds:.0f} CPU s"
        if self.verdict == "FAIL":
            tail = f"{self.failure()}; {tail}"
        if self.verdict == "WIDTH-DEPENDENT":
            tail += (f"; the algorithm is exact (fp64 cases above), but {self.width.label} samples from its law at "
                     "the verification width, which differs from the plain loop's by the TV above: no PASS")
        lines += ["", f"{self.verdict}: {tail}"]
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
            power_result: Power | None = None, batch_n: int | None = None, target: Target | None = None,
            width_prompts: int = 8, width_tokens: int = 24, cache: str = "dynamic",
            buckets: Sequence[int] | None = None) -> Certificate:
    """Run the greedy identity, the drafter's distribution and batched cases (`batch_n` batches per
    case, default n / 2; 0 skips them) and the power section for `name` (power_n = 0 skips the power
    section; such a certificate cannot pass). The power section does not depend on the drafter:
    `power_result` reuses one already run (its CPU time is counted). With a real `target`, the width
    effect of the drafter (built with `options` only) is measured on `width_prompts` prompts. The greedy
    identity and the drafter's cases (not the coverage cases) run on `cache`, e.g. `compiled` (at `buckets`)."""
    start = time.process_time()
    world = tiny_world()
    cert = Certificate(name, dict(options or {}), cache=cache)
    for shape in greedy_shapes or GREEDY_SHAPES:
        cert.greedy[shape] = next(filter(None, (greedy_case(t, build_drafter(name, t, options), shape, cache=cache,
                                                            buckets=buckets) for t in world.greedy_targets)), None)
    drafter = build_drafter(name, world.target, options)
    cert.cases = drafter_cases(world, drafter, shapes, n, samplings, eos, coverage, cache, buckets)
    batch_n = n // 2 if batch_n is None else batch_n
    greedy_drafter = build_drafter(name, world.greedy_targets[0], options)
    cert.batch = batch_cases(world, drafter, batch_n, shapes=shapes, greedy_drafter=greedy_drafter) if batch_n else []
    cert.power = power_result or (power(world, power_n, n) if power_n else None)
    if target is not None:
        real = build(name, target=target, **dict(options or {}))
        cert.width = widths.width_effect(target, real, widths.PROMPTS[:width_prompts], tokens=width_tokens)
    cert.seconds = time.process_time() - start + (power_result.seconds if power_result else 0.0)
    return cert


def split_shapes(text: str) -> list[str]:
    """`chain(2);tree(2,2)` or `chain(2) tree(2,2)` -> shape strings (commas live inside shapes)."""
    shapes = [s for s in text.replace(";", " ").split() if s]
    for s in shapes:
        specdec.parse_shape(s)
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.certify", description=__doc__.split("\n")[0],
                                     epilog="exit status: 0 PASS, 1 FAIL, 2 bad input, 3 WIDTH-DEPENDENT")
    parser.add_argument("drafter", nargs="?", help=f"a registered drafter ({', '.join(specdec.drafters.names())})")
    parser.add_argument("--shapes", default=" ".join(DISTRIBUTION_SHAPES),
                        help="draft shapes of the distribution cases, separated by ';' or spaces")
    parser.add_argument("--options", default="", help="drafter options k=v,... (override its test_options)")
    parser.add_argument("-n", type=int, default=250, help="generations per distribution case (default 250)")
    parser.add_argument("--power-n", type=int, default=POWER_N, help="generations per reference case (0 = skip)")
    parser.add_argument("--target", help="also measure the width effect on this target (e.g. smollm2-135m)")
    parser.add_argument("--dtype", default=None, help="the target's dtype (e.g. bfloat16)")
    parser.add_argument("--kernel", default="auto", help="the target's linear kernel")
    parser.add_argument("--quant", default=None, help="the target's quantization spec")
    parser.add_argument("--cache", default="dynamic", help="what the greedy and drafter cases run on, e.g. compiled")
    parser.add_argument("--width-prompts", type=int, default=8, help="prompts of the width effect (2..12)")
    parser.add_argument("--self-test", action="store_true",
                        help="only the power section: one JSON line {control: p, mutants: {name: p}}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.self_test:
        result = power(tiny_world(), args.power_n or POWER_N, args.n)
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
        if not 2 <= args.width_prompts <= len(widths.PROMPTS):
            raise ValueError(f"--width-prompts {args.width_prompts}: between 2 and {len(widths.PROMPTS)}")
        target = None if args.target is None else specdec.load_target(
            args.target, dtype=args.dtype, kernel=args.kernel, quant=args.quant, threads=1)
    except (ValueError, KeyError) as err:
        print(f"certify: {err.args[0]}", file=sys.stderr)
        return 2
    cert = certify(args.drafter, shapes=shapes, options=options, n=args.n, power_n=args.power_n, target=target,
                   width_prompts=args.width_prompts, cache=args.cache)
    print(cert.text())
    print(cert.json_line())
    return {"PASS": 0, "FAIL": 1, "WIDTH-DEPENDENT": 3}[cert.verdict]

