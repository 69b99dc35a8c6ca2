"""The width effect: how far a drafted run's next-token law is from the plain loop's on the same text. Owns
`token_laws`, `prompt_width_effect` (TV, top-2 gap shift, argmax changes per position) and `width_effect` (over
prompts x shapes, with a t-interval over prompts). Knows nothing about certificates or records.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from scipy import stats

from specdec.core import acceptance
from specdec.core.draft import Drafter
from specdec.loop.decode import DecodeConfig, decode
from specdec.runtime.model import Target

PROMPTS = (
    "What are three simple ways to get better sleep? Keep it short.",
    "Explain to a ten-year-old why the sky is blue.",
    "List the first ten prime numbers.",
    "Write a haiku about a rainy Monday morning.",
    "How does a bicycle stay upright while moving?",
    "Give me a recipe for a quick tomato pasta.",
    "Summarize: The cat sat on the mat. The cat was happy. The mat was red.",
    "What is the difference between weather and climate?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a short Python function that reverses a string.",
    "Why do leaves change colour in autumn?",
    "Suggest a name for a small bakery that sells bread and coffee.",
)
"""Chat prompts of the measurement (the first `prompts` of them are used)."""
SHAPES = ("chain(4)", "tree(3,2,2)")
TEMPERATURES = (0.7, 1.0)


@dataclass
class Laws:
    """One run's committed tokens and, per token, the logits it was decided on and its forward's width."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # float64 [V] per committed token.
    widths: list[int] = field(default_factory=list)


def token_laws(target: Target, drafter: Drafter | None, prompt_ids: Sequence[int], *, shape: str = "chain(4)",
               temperature: float = 1.0, max_new_tokens: int = 32, seed: int = 0,
               force: Sequence[int] | None = None) -> Laws:
    """Decode once and return each committed token with the logits row it was decided on (read from the
    loop's events) and its forward's width. `force`: the tokens to commit instead (teacher forcing)."""
    laws = Laws()
    config = DecodeConfig(shape=shape, max_new_tokens=len(force) if force is not None else max_new_tokens,
                          temperature=temperature, seed=seed, stop_on_eos=False,
                          force=None if force is None else [list(force)])
    for event in decode(target, drafter, [list(prompt_ids)], config):
        for row, token in zip([0] + [j + 1 for j in event.paths[0]], event.committed[0]):
            laws.tokens.append(token)
            laws.logits.append(event.logits[0, row].detach().double().cpu())
            laws.widths.append(event.width)
    return laws


def total_variation(a: torch.Tensor, b: torch.Tensor, temperature: float) -> float:
    """TV distance between softmax(a / T) and softmax(b / T) (float64)."""
    return float(acceptance.total_variation((a / temperature).softmax(-1), (b / temperature).softmax(-1)))


@dataclass
class PromptEffect:
    """The width effect along one drafted run."""

    shape: str
    temperature: float
    tv: list[float]  # Per committed token: TV between the drafted run's law and the plain loop's.
    gap_shift: list[float]
    """Per token: |change| of the plain loop's top-1 minus top-2 logit gap in the drafted run's logits."""
    argmax_differs: int
    widths: list[int]
    prompt: int = 0  # Index of the prompt in the measurement.

    @property
    def mean_tv(self) -> float:
        return sum(self.tv) / len(self.tv)


def prompt_width_effect(target: Target, drafter: Drafter, prompt_ids: Sequence[int], shape: str,
                        temperature: float, tokens: int = 32, seed: int = 0) -> PromptEffect:
    """A drafted run at `temperature`, then the plain loop teacher-forced on its text; compare per token."""
    drafted = token_laws(target, drafter, prompt_ids, shape=shape, temperature=temperature, max_new_tokens=tokens,
                         seed=seed)
    plain = token_laws(target, None, prompt_ids, temperature=temperature, seed=seed, force=drafted.tokens)
    tv, shift, differs = [], [], 0
    for d, p in zip(drafted.logits, plain.logits):
        tv.append(total_variation(d, p, temperature))
        top1, top2 = p.topk(2).indices.tolist()
        shift.append(abs(float((d[top1] - d[top2]) - (p[top1] - p[top2]))))
        differs += int(d.argmax()) != top1
    return PromptEffect(shape, temperature, tv, shift, differs, drafted.widths)


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): a Student-t interval of the mean over `values` (one per prompt)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a confidence interval needs at least 2 prompts, got {n}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass
class WidthEffect:
    """The width effect of one target and drafter over prompts x shapes x temperatures."""

    target: str
    dtype: str
    kernel: str
    quant: str
    drafter: str
    tokens: int
    prompts: int
    effects: list[PromptEffect] = field(default_factory=list)
    exact_arithmetic: bool = False
    """The target computes in fp32/fp64, unquantized, with the torch kernel (`exact_arithmetic`)."""
    cpu_seconds: float = 0.0  # Process CPU time of the measurement.

    @property
    def label(self) -> str:
        quant = "" if self.quant in ("none", None) else f" {self.quant}"
        return f"{self.target} ({self.dtype}{quant}, kernel {self.kernel})"

    def tv(self, temperature: float, shape: str | None = None) -> tuple[float, float, float]:
        """Mean TV per token with its 95% CI over prompts (each prompt's mean over its tokens and
        over the shapes, or over one `shape`)."""
        per_prompt: dict[int, list[float]] = {}
        for e in self.effects:
            if e.temperature == temperature and shape in (None, e.shape):
                per_prompt.setdefault(e.prompt, []).append(e.mean_tv)
        return mean_ci([sum(v) / len(v) for v in per_prompt.values()])

    @property
    def max_gap_shift(self) -> float:
        return max(max(e.gap_shift) for e in self.effects)

    def lines(self) -> list[str]:
        return lines(self)

    def json(self) -> dict:
        """`summary` (the per-temperature rows only) with `exact_arithmetic`."""
        s = self.summary()
        s["width_effect"] = [r for r in s["width_effect"] if r["shape"] == "all"]
        return {**s, "exact_arithmetic": self.exact_arithmetic, "cpu_seconds": round(self.cpu_seconds, 1)}

    def summary(self) -> dict:
        """The measurement as a JSON-able dict (per temperature, pooled and per shape)."""
        temps = sorted({e.temperature for e in self.effects})
        shapes = list(dict.fromkeys(e.shape for e in self.effects))
        rows = []
        for t in temps:
            for shape in (None, *shapes):
                mean, lo, hi = self.tv(t, shape)
                sel = [e for e in self.effects if e.temperature == t and shape in (None, e.shape)]
                widths = [w for e in sel for w in e.widths]
                rows.append({"temperature": t, "shape": shape or "all", "tv_per_token": mean, "ci_low": lo,
                             "ci_high": hi, "tokens": sum(len(e.tv) for e in sel),
                             "max_tv": max(max(e.tv) for e in sel),
                             "argmax_differs": sum(e.argmax_differs for e in sel),
                             "mean_width": sum(widths) / len(widths)})
        shifts = sorted(s for e in self.effects for s in e.gap_shift)
        return {"target": self.target, "dtype": self.dtype, "kernel": self.kernel, "quant": self.quant,
                "drafter": self.drafter, "prompts": self.prompts, "tokens_per_run": self.tokens,
                "shapes": shapes, "width_effect": rows, "max_gap_shift": shifts[-1],
                "p99_gap_shift": shifts[min(len(shifts) - 1, int(0.99 * len(shifts)))]}


def lines(effect: WidthEffect) -> list[str]:
    """The width effect as certificate lines: TV per token with its CI per temperature."""
    out = [f"Width effect on {effect.label}, drafter {effect.drafter!r}: TV per token between a drafted run's "
           f"next-token law and the plain loop's on the same text ({effect.prompts} prompts x "
           f"{', '.join(dict.fromkeys(e.shape for e in effect.effects))} x {effect.tokens} tokens, 95% CI over prompts):"]
    for row in effect.summary()["width_effect"]:
        if row["shape"] == "all":
            out.append(f"  T = {row['temperature']:<4g} TV per token {row['tv_per_token']:.3g} "
                       f"[{row['ci_low']:.3g}, {row['ci_high']:.3g}], max {row['max_tv']:.3g}, argmax differs at "
                       f"{row['argmax_differs']} of {row['tokens']} tokens, mean width {row['mean_width']:.1f}")
    out.append(f"  largest shift of the top-1 minus top-2 logit gap: {effect.max_gap_shift:.3g}; "
               f"{effect.cpu_seconds:.0f} CPU s")
    return out


def width_effect(target: Target, drafter: Drafter, prompts: Sequence[str | Sequence[int]] = PROMPTS, *,
                 shapes: Sequence[str] = SHAPES, temperatures: Sequence[float] = TEMPERATURES,
                 tokens: int = 32, seed: int = 0) -> WidthEffect:
    """Measure the width effect of `target` with `drafter` over `prompts` (>= 2) x shapes x temperatures."""
    if len(prompts) < 2:
        raise ValueError(f"the width effect's CI is over prompts: give at least 2, got {len(prompts)}")
    result = WidthEffect(target.name, str(target.dtype).removeprefix("torch."), target.kernel, target.quant,
                         getattr(drafter, "name", type(drafter).__name__), tokens, len(prompts),
                         exact_arithmetic=exact_arithmetic(target))
    start = time.process_time()
    for i, prompt in enumerate(prompts):
        ids = target.encode_prompt(prompt)
        for shape in shapes:
            for t in temperatures:
                effect = prompt_width_effect(target, drafter, ids, shape, t, tokens, seed)
                effect.prompt = i
                result.effects.append(effect)
    result.cpu_seconds = time.process_time() - start
    return result


def exact_arithmetic(target: Target) -> bool:
    """True when the target computes in fp32 or fp64 with unquantized weights and the plain torch
    kernel: its law does not depend on the forward's width beyond rounding of order 1e-6."""
    return target.dtype in (torch.float32, torch.float64) and target.quant in ("none", None) \
        and target.kernel == "torch"


