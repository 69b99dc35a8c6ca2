"""An exactness certificate for any registered drafter: `python -m specdec.certify DRAFTER`.

Owns the exactness harness that the test suite and the command line share:
- `greedy_case`: at T = 0 the loop's output equals the cacheless reference's greedy output, token
  for token (fp64 tiny models of three families);
- `distribution_case`: at T > 0, Pearson's chi-square of the first `LENGTH` generated tokens of
  `n` seeded generations against the target's exact law (enumerated with `reference`), with EOS
  stopping off or on (on: the exact law pushed through "cut after the first EOS");
- `power`: the same chi-square harness with each of three wrong acceptance rules patched into the
  verifier (`wrong_rule`), on a case built to reject often (`SiblingDrafter`, a synthetic drafter
  whose siblings carry draft probabilities, against a peaky target it disagrees with);
- `certify` + `main`: all of it for one drafter, a readable certificate and one JSON line last.
Knows nothing about any particular drafter: it builds them by name through the registry, with the
factory's `test_options` under the user's `--options`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from scipy.stats import chisquare

import specdec
from specdec.core import tree as tree_ops
from specdec.core import acceptance
from specdec.core.draft import Acceptance, Draft, Drafter, DraftRequest
from specdec.drafters.registry import build, parse_options
from specdec.drafters.registry import _REGISTRY as _DRAFTERS
from specdec.target.model import Target
from specdec.core.reference import exact_joint_probs, next_token_logits, reference_generate
from specdec.core.sampling import SamplingConfig

VOCAB = 5
"""Vocabulary of the T > 0 models: small enough to enumerate V^LENGTH sequences exactly."""
LENGTH = 3
"""Tokens per generation compared with the exact law (the joint of the first LENGTH tokens)."""
ALPHA = 1e-4
"""A case passes when its chi-square p-value is >= ALPHA."""
POWER_ALPHA = 1e-6
"""A wrong rule counts as detected when its p-value is < POWER_ALPHA."""
DISTRIBUTION_SHAPES = ("chain(2)", "tree(2,2)", "dynamic(top_k=2,depth=2,budget=4)")
GREEDY_SHAPES = ("chain(1)", "chain(4)", "tree(3,2,2)", "dynamic(top_k=3,depth=5,budget=12)")
SAMPLINGS = {
    "plain": SamplingConfig(temperature=1.0),
    "top-k": SamplingConfig(temperature=0.8, top_k=3),
    "top-p": SamplingConfig(temperature=1.0, top_p=0.8),
}
GREEDY_PROMPTS = ([1, 5, 9, 5, 9, 5, 9, 13], [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 2, 3, 5])
SAMPLE_PROMPT = (1, 2, 3, 1, 2)
"""Prompt of the T > 0 cases; its repeats give prompt-lookup drafters something to propose."""
FAMILIES = ("llama", "qwen2", "mistral")


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


def tiny_world() -> World:
    """Build the certificate's models (seeded: every run sees the same weights)."""
    greedy = tuple(specdec.tiny_target(f, vocab_size=64, dtype=torch.float64, seed=0, logit_scale=4.0)
                   for f in FAMILIES)
    small = dict(vocab_size=VOCAB, hidden_size=16, dtype=torch.float64, logit_scale=6.0)
    return World(greedy, specdec.tiny_target("llama", seed=0, **small), specdec.tiny_target("llama", seed=7, **small))


def build_drafter(name: str, target: Target, options: dict | None = None) -> Drafter:
    """Build `name` for a tiny `target`: its factory's `test_options`, overridden by `options`."""
    if name not in _DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; registered drafters: {', '.join(specdec.drafters.names())}")
    defaults = getattr(_DRAFTERS[name], "test_options", {})
    return build(name, target=target, **{**defaults, **(options or {})})


# ---- T = 0 ----------------------------------------------------------------------------------------


def greedy_case(target: Target, drafter: Drafter, shape: str, prompts: Sequence[Sequence[int]] = GREEDY_PROMPTS,
                max_new_tokens: int = 20) -> str | None:
    """None when the drafter's greedy output equals the reference on every prompt, else what diverged."""
    for prompt in prompts:
        ref = reference_generate(target, prompt, max_new_tokens=max_new_tokens, stop_on_eos=False)
        out = specdec.generate(target, drafter, list(prompt), shape=shape, max_new_tokens=max_new_tokens,
                               stop_on_eos=False).token_ids
        if out != ref:
            first = next(i for i, (a, b) in enumerate(zip(out + [None] * len(ref), ref)) if a != b)
            return f"{target.model.config.model_type} {shape} prompt {list(prompt)}: token {first} differs"
    return None


# ---- T > 0 ----------------------------------------------------------------------------------------


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


def pick_eos(target: Target, prompt: Sequence[int], sampling: SamplingConfig) -> int:
    """The token whose first occurrence in LENGTH tokens is closest to a fair coin: EOS then stops
    about half of the generations early, so both stopped and unstopped paths are tested."""
    law = exact_joint_probs(target, list(prompt), LENGTH, sampling)
    hit = {t: sum(p for seq, p in law.items() if t in seq) for t in range(target.vocab_size)}
    return min(hit, key=lambda t: abs(hit[t] - 0.5))


@contextmanager
def eos_token(target: Target, token: int | None) -> Iterator[None]:
    """Make `token` the target's only EOS for the duration (None: no EOS)."""
    config = target.model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = token
    model_saved = getattr(target.model.config, "eos_token_id", None)
    target.model.config.eos_token_id = None
    try:
        yield
    finally:
        config.eos_token_id = saved
        target.model.config.eos_token_id = model_saved


def chi_square_p(counts: Counter, law: dict[tuple[int, ...], float], n: int) -> float:
    """Pearson's chi-square p-value of `counts` (n draws) against `law`.

    Cells are binned before the test so that every bin expects >= 5 draws: sequences in order of
    decreasing probability fill a bin until it does, and a short last bin joins the one before.
    The bins depend on the law only, never on the counts. Worked example: n = 100, probabilities
    .3, .2, .04, .03, .02, .01 ... -> bins {.3}, {.2}, {.04, .03}, {.02, .01, ...}."""
    if not set(counts) <= set(law):
        raise AssertionError(f"sampled {sorted(set(counts) - set(law))[:3]}, which the target gives probability 0")
    bins: list[list[tuple[int, ...]]] = []
    filled = 0.0
    for cell in sorted(law, key=lambda c: (-law[c], c)):
        if not bins or filled * n >= 5:
            bins.append([])
            filled = 0.0
        bins[-1].append(cell)
        filled += law[cell]
    if len(bins) > 1 and filled * n < 5:
        bins[-2].extend(bins.pop())
    if len(bins) < 2:
        return 1.0
    observed = [sum(counts[c] for c in b) for b in bins]
    expected = [sum(law[c] for c in b) * n for b in bins]
    return float(chisquare(observed, expected).pvalue)


@dataclass
class CaseResult:
    """One distribution case of a certificate."""

    shape: str
    sampling: str
    eos: bool
    n: int
    p_value: float
    drafted: int = 0
    """Draft nodes proposed over all n generations."""
    accepted: int = 0
    """Draft tokens accepted over all n generations."""
    rejections: int = 0
    """Steps that ended in a recovered (not bonus) token after a non-empty draft."""
    steps: int = 0

    def row(self) -> dict:
        return {"shape": self.shape, "sampling": self.sampling + (" eos" if self.eos else ""), "n": self.n,
                "p_value": self.p_value}


def distribution_case(target: Target, drafter: Drafter, shape: str, sampling_name: str, n: int,
                      eos: bool = False, prompt: Sequence[int] = SAMPLE_PROMPT, length: int = LENGTH) -> CaseResult:
    """Sample n seeded generations of `length` tokens and test them against the target's exact law."""
    sampling = SAMPLINGS[sampling_name]
    stop = pick_eos(target, prompt, sampling) if eos else None
    result = CaseResult(shape, sampling_name, eos, n, 1.0)
    counts: Counter = Counter()
    with eos_token(target, stop):
        for seed in range(n):
            out = specdec.generate(target, drafter, list(prompt), shape=shape, max_new_tokens=length,
                                   temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                   seed=seed, stop_on_eos=eos)
            counts[tuple(out.token_ids)] += 1
            for s in out.stats.steps:
                result.steps += 1
                result.drafted += s.drafted
                result.accepted += s.accepted
                result.rejections += bool(s.drafted) and not s.bonus
    result.p_value = chi_square_p(counts, exact_law(target, prompt, sampling, {stop} if eos else set(), length), n)
    return result


# ---- power: wrong rules and the case that exposes them ------------------------------------------

WRONG_RULES = ("resample_from_target", "residual_from_original", "accept_against_original")
"""The three classic mistakes of recursive rejection sampling over siblings:
- resample_from_target: after a rejection, continue (and finally sample) from the node's target
  instead of the residual;
- residual_from_original: each sibling's residual is taken from the node's original target instead
  of the running residual (rejected siblings come back);
- accept_against_original: sibling i is accepted with min(1, target(x) / draft(x)) against the
  node's original target instead of the running residual."""


def wrong_rule(rule: str):
    """A stand-in for `acceptance.accept_sampling` with one of `WRONG_RULES`, built from the verifier's
    own pure functions; the same walk as the verifier with that one step changed (a mutant)."""
    if rule not in WRONG_RULES:
        raise ValueError(f"unknown wrong rule {rule!r}; known: {', '.join(WRONG_RULES)}")

    def accept_sampling(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
        tokens = draft.tokens[0].tolist()
        kids = tree_ops.children(draft.parents)
        path, node = [], -1
        while True:
            original = probs = target_probs[node + 1]  # [V]
            accepted = None
            for child in kids[node]:
                x = tokens[child]
                if draft.draft_probs is None:
                    child_draft = torch.nn.functional.one_hot(torch.tensor(x), probs.numel()).to(probs.dtype)
                else:
                    child_draft = draft.draft_probs[0, child].to(probs.dtype)
                against = original if rule == "accept_against_original" else probs
                u = torch.rand((), generator=generator, device=probs.device)
                if bool(u < acceptance.acceptance_probability(against[x], child_draft[x])):
                    accepted = child
                    break
                if rule == "resample_from_target":
                    probs = original
                elif rule == "residual_from_original":
                    probs = acceptance.residual_probs(original, child_draft)
                else:
                    probs = acceptance.residual_probs(probs, child_draft)
            if accepted is None:
                token = int(torch.multinomial(probs, 1, generator=generator))
                return Acceptance(path=path, next_token=token, bonus=not kids[node])
            path.append(accepted)
            node = accepted

    return accept_sampling


@contextmanager
def patched_rule(rule: str) -> Iterator[None]:
    """Run the verifier with `wrong_rule(rule)` in place of its acceptance rule."""
    saved = acceptance.accept_sampling
    acceptance.accept_sampling = wrong_rule(rule)
    try:
        yield
    finally:
        acceptance.accept_sampling = saved


class SiblingDrafter:
    """Synthetic drafter: every node gets `width` sampled siblings up to `depth`, each with its draft
    probabilities recorded, i.i.d. (`replace=True`) or without replacement (each sibling's recorded
    distribution is the conditional one given the earlier siblings, renormalised); or, with
    `point_mass=True`, its top-`width` tokens as deterministic siblings without draft probabilities.

    Its distribution after a context is softmax(sharpen x `like`'s logits + noise x N(0, 1)), the
    noise seeded by the context (so it is a fixed function of the context); without `like`, pure
    noise. A `like` target sharpened (sharpen > 1) gives the peaky mismatch that makes the power
    cases reject often: the draft piles its mass on the target's favourite token, is rejected there
    about as often as the target doubts it, and the next sibling then meets a heavily reshaped
    residual, where every wrong rule shows."""

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

    def commit(self, step) -> None:
        pass


POWER_N = 600
"""Generations per power case."""
POWER_SHAPE = "tree(3)"
POWER_LENGTH = 2


def power_world() -> tuple[Target, Drafter]:
    """The power case: a flat-ish VOCAB-token target and point-mass siblings at its three most likely
    tokens (`tree(3)`, 2 tokens generated). The first sibling is rejected about 3 times in 4, the
    second often too, and every wrong rule then moves a large share of the first token's mass: with
    top tokens of probability p1, p2, accepting the second against the original target instead of
    the running residual gives it p2 (1 - p1) instead of p2."""
    target = specdec.tiny_target("llama", vocab_size=VOCAB, hidden_size=16, dtype=torch.float64, seed=3,
                                 logit_scale=1.5)
    return target, SiblingDrafter(VOCAB, width=3, depth=1, like=target, noise=0.0, point_mass=True)


def power(n: int = POWER_N) -> dict[str, CaseResult]:
    """Each wrong rule run through the same harness on the power case; detected when p < POWER_ALPHA."""
    target, drafter = power_world()
    results = {}
    for rule in WRONG_RULES:
        with patched_rule(rule):
            results[rule] = distribution_case(target, drafter, POWER_SHAPE, "plain", n, length=POWER_LENGTH)
    return results


# ---- the certificate ----------------------------------------------------------------------------


@dataclass
class Certificate:
    drafter: str
    options: dict
    greedy: dict[str, str | None] = field(default_factory=dict)
    """shape -> None (identical on every family and prompt) or what diverged."""
    cases: list[CaseResult] = field(default_factory=list)
    power: dict[str, CaseResult] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def min_p(self) -> float:
        return min((c.p_value for c in self.cases), default=1.0)

    @property
    def passed(self) -> bool:
        return (all(v is None for v in self.greedy.values()) and self.min_p >= ALPHA
                and all(r.p_value < POWER_ALPHA for r in self.power.values()))

    def json_line(self) -> str:
        return json.dumps({"drafter": self.drafter, "cases": [c.row() for c in self.cases], "min_p": self.min_p,
                           "power": {rule: r.p_value for rule, r in self.power.items()}})

    def text(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items()) or "test defaults"
        lines = [f"Exactness certificate: drafter {self.drafter!r} ({opts})", "",
                 f"Greedy identity (T = 0, {len(FAMILIES)} fp64 families x {len(GREEDY_PROMPTS)} prompts x 20 tokens, "
                 "vs the cacheless reference):"]
        lines += [f"  {shape:<40} {'identical' if why is None else 'DIVERGED: ' + why}"
                  for shape, why in self.greedy.items()]
        lines += ["", f"Distribution (T > 0, chi-square of the first {LENGTH} tokens vs the exact law, "
                  f"vocab {VOCAB}, pass at p >= {ALPHA:g}):",
                  f"  {'shape':<36} {'sampling':<11} {'n':>5} {'p-value':>9}  accepted/drafted  rejected steps"]
        for c in self.cases:
            lines.append(f"  {c.shape:<36} {c.row()['sampling']:<11} {c.n:>5} {c.p_value:>9.3g}  "
                         f"{c.accepted:>6}/{c.drafted:<9} {c.rejections:>6}/{c.steps}")
        lines += ["", f"Power (the same harness with a wrong rule patched in; detected at p < {POWER_ALPHA:g}):"]
        for rule, r in self.power.items():
            verdict = "detected" if r.p_value < POWER_ALPHA else "NOT DETECTED"
            lines.append(f"  {rule:<26} p = {r.p_value:.2e}  {verdict}  (n = {r.n}, "
                         f"{r.rejections}/{r.steps} steps rejected)")
        lines += ["", f"{'PASS' if self.passed else 'FAIL'}: min p = {self.min_p:.3g}, {self.seconds:.0f} s"]
        return "\n".join(lines)


def certify(name: str, *, shapes: Sequence[str] = DISTRIBUTION_SHAPES, options: dict | None = None,
            n: int = 250, samplings: Sequence[str] = tuple(SAMPLINGS), eos: Sequence[bool] = (False, True),
            power_n: int = POWER_N, greedy_shapes: Sequence[str] | None = None) -> Certificate:
    """Run the greedy identity, the distribution cases and the power cases for drafter `name`."""
    start = time.perf_counter()
    world = tiny_world()
    cert = Certificate(name, dict(options or {}))
    for shape in greedy_shapes or GREEDY_SHAPES:
        cert.greedy[shape] = next(filter(None, (greedy_case(t, build_drafter(name, t, options), shape)
                                                for t in world.greedy_targets)), None)
    drafter = build_drafter(name, world.target, options)
    for shape in shapes:
        for sampling in samplings:
            for stop in eos:
                cert.cases.append(distribution_case(world.target, drafter, shape, sampling, n, stop))
    cert.power = power(power_n) if power_n else {}
    cert.seconds = time.perf_counter() - start
    return cert


def split_shapes(text: str) -> list[str]:
    """`chain(2);tree(2,2)` or `chain(2) tree(2,2)` -> shape strings (commas live inside shapes)."""
    shapes = [s for s in text.replace(";", " ").split() if s]
    for s in shapes:
        specdec.parse_shape(s)
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.certify", description=__doc__.split("\n")[0])
    parser.add_argument("drafter", help=f"a registered drafter ({', '.join(specdec.drafters.names())})")
    parser.add_argument("--shapes", default=" ".join(DISTRIBUTION_SHAPES),
                        help="draft shapes of the distribution cases, separated by ';' or spaces")
    parser.add_argument("--options", default="", help="drafter options k=v,... (override its test_options)")
    parser.add_argument("-n", type=int, default=250, help="generations per distribution case (default 250)")
    parser.add_argument("--power-n", type=int, default=POWER_N, help="generations per power case (0 = skip)")
    args = parser.parse_args(argv)
    try:
        shapes = split_shapes(args.shapes)
        options = parse_options(args.options)
        if args.drafter not in specdec.drafters.names():
            raise KeyError(f"unknown drafter {args.drafter!r}; registered: {', '.join(specdec.drafters.names())}")
    except (ValueError, KeyError) as err:
        print(f"certify: {err.args[0]}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    cert = certify(args.drafter, shapes=shapes, options=options, n=args.n, power_n=args.power_n)
    print(cert.text())
    print(cert.json_line())
    return 0 if cert.passed else 1


if __name__ == "__main__":
    sys.exit(main())
