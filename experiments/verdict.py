"""Verdict rules with a known answer: the paired interaction of a cell and what its interval supports.

Owns the per-prompt interaction of a paired cell (`experiments.cell`: four runs per prompt), its bootstrap interval
over prompts, the three-way rule, the prompts an inconclusive interval would need, and the drift of the fp32 plain
loop across a job. Knows nothing about stores or files. Per question q: r(q) = s_k(q) / s_0(q), s = drafted / plain
tokens/s on the kernel (k) or fp32 (0); the interaction is the geometric mean of r(q), with a 95% percentile bootstrap
interval [lo, hi]. Rules: *fight*: hi < 1; *compound*: lo >= 0.9 and not a fight; *inconclusive*: otherwise
(`prompts_to_settle`: half-width as 1 / sqrt(n)). An A/A control has interaction exactly 1: it must read compound.
The decomposition (`factor_logs`): per question s = M / (R + d), so the interaction = (M_k / M_0) x
(R_0 + d_0) / (R_k + d_k) x prefill, the middle factor split between R and d by Shapley (both orders, in logs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

MARGIN = 0.9
"""The equivalence margin: an interaction whose interval stays at or above it is "compound"."""
MIN_QUESTIONS = 4
"""Fewer questions than this give no interval (a bootstrap over 3 values is not one)."""
RUN_COLUMNS = {"drafted": ("new_tokens", "wall_time_s"), "plain": ("baseline_new_tokens", "baseline_wall_time_s"),
               "reference": ("reference_new_tokens", "reference_wall_time_s"),
               "reference_drafted": ("reference_drafted_new_tokens", "reference_drafted_wall_time_s")}


@dataclass(frozen=True)
class Interaction:
    """A cell's interaction with its interval and the verdict the interval supports."""

    point: float
    lo: float
    hi: float
    questions: int
    label: str
    """fight, compound or inconclusive."""
    settle: int | None
    """Prompts that would settle an inconclusive interval (None when settled)."""
    factors: dict = field(default_factory=dict)
    """{name: (point, lo, hi)} of `FACTORS` on the verdict's own bootstrap draws ({} under `MIN_QUESTIONS`);
    `same_text` is the share of questions whose drafted text equals the kernel's plain text and
    `same_text_interaction` the interaction on them (point only)."""

    def text(self) -> str:
        more = f"; ~{self.settle} prompts would settle it" if self.settle else ""
        return f"{self.label} (interaction {self.point:.2f} [{self.lo:.2f}, {self.hi:.2f}], {self.questions} prompts{more})"


def classify(lo: float, hi: float) -> str:
    """fight / compound / inconclusive from an interaction interval (see the module docstring)."""
    if hi < 1.0:
        return "fight"
    if lo >= MARGIN:
        return "compound"
    return "inconclusive"


def prompts_to_settle(point: float, lo: float, hi: float, questions: int) -> int | None:
    """Questions that would make [lo, hi] settle (fight or compound) with the same per-question spread
    and point; None when it is settled. In log units the half-width h shrinks as 1 / sqrt(n); the
    rule needs h < -log(point) (fight) or h <= log(point / 0.9) (compound), whichever is larger.
    E.g. point 0.95 [0.80, 1.10] on 8 prompts: h = 0.16, need 0.054 (compound) -> 8 * (0.16/0.054)^2 = 70."""
    if classify(lo, hi) != "inconclusive":
        return None
    h = (math.log(hi) - math.log(lo)) / 2
    m = math.log(point)
    needed = max(-m, m - math.log(MARGIN))
    return max(questions + 1, math.ceil(questions * (h / needed) ** 2))


def per_question(rows: pd.DataFrame) -> pd.DataFrame:
    """Tokens/s of the four runs per question (turns pooled), columns = `RUN_COLUMNS`' keys."""
    sums = rows.groupby("question_id")[[c for pair in RUN_COLUMNS.values() for c in pair]].sum()
    return pd.DataFrame({run: sums[tokens] / sums[wall] for run, (tokens, wall) in RUN_COLUMNS.items()})


def gmean_ci(logs: np.ndarray, draws: np.ndarray) -> tuple[float, float, float]:
    """Geometric mean of exp(logs) [Q] with a 95% percentile bootstrap interval over `draws` [B, Q]
    (question indices; NaN bounds under 2 values or no draws)."""
    point = float(np.exp(logs.mean()))
    if len(logs) < 2 or len(draws) == 0:
        return point, math.nan, math.nan
    boot = np.exp(logs[draws].mean(1))  # [B]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return point, float(lo), float(hi)


def factor_logs(rows: pd.DataFrame) -> pd.DataFrame:
    """Per question (turns pooled), the logs of the interaction, the decode-only one, `FACTORS` and R of each kernel
    (`r_kernel`, `r_fp32`: the in-run cost of a verify step in plain steps); see the module docstring."""
    speed = per_question(rows)
    out = pd.DataFrame({"interaction": np.log((speed.drafted / speed.plain) / (speed.reference_drafted / speed.reference))})
    s = rows.groupby("question_id").sum(numeric_only=True)

    def run(prefix: str, plain: str) -> tuple[pd.Series, pd.Series, pd.Series]:
        step = (s[f"{plain}wall_time_s"] - s[f"{plain}prefill_time_s"]) / s[f"{plain}steps"]  # a plain decode step
        steps = s[f"{prefix}steps"]
        r = s[f"{prefix}verify_time_s"] / steps / step
        d = (s[f"{prefix}wall_time_s"] - s[f"{prefix}prefill_time_s"]) / steps / step - r
        return r, d, (s[f"{prefix}new_tokens"] / steps) / (s[f"{plain}new_tokens"] / s[f"{plain}steps"])

    (rk, dk, mk), (r0, d0, m0) = run("", "baseline_"), run("reference_drafted_", "reference_")
    cost = lambda r, d: -np.log(r + d)  # noqa: E731 -- log of 1 / (R + d)
    out["width"] = (cost(rk, d0) - cost(r0, d0) + cost(rk, dk) - cost(r0, dk)) / 2
    out["drafting"] = (cost(r0, dk) - cost(r0, d0) + cost(rk, dk) - cost(rk, d0)) / 2
    out["mal"] = np.log(mk / m0)
    out["decode"] = out.mal + out.width + out.drafting
    out["prefill"] = out.interaction - out.decode
    out["timing"] = out.interaction - out.mal  # width x drafting x prefill: the interaction at equal acceptance
    out["r_kernel"], out["r_fp32"] = np.log(rk), np.log(r0)
    return out


FACTORS = ("mal", "width", "drafting", "prefill", "decode", "timing", "r_kernel", "r_fp32")
"""The decomposition's columns of `factor_logs` (their first four multiply to the interaction)."""


def interaction(rows: pd.DataFrame, n_boot: int, rng: np.random.Generator) -> Interaction:
    """The cell's interaction, its 95% bootstrap interval over questions, its verdict and its
    decomposition (`Interaction.factors`, on the same bootstrap draws)."""
    frame = factor_logs(rows)
    logs = frame.interaction.to_numpy(float)  # [Q]
    if len(logs) < MIN_QUESTIONS or n_boot <= 0:
        return Interaction(float(np.exp(logs.mean())), math.nan, math.nan, len(logs), "inconclusive", MIN_QUESTIONS)
    draws = rng.integers(0, len(logs), size=(n_boot, len(logs)))  # [B, Q]: one draw for every statistic
    point, lo, hi = gmean_ci(logs, draws)
    factors = {k: gmean_ci(frame[k].to_numpy(float), draws) for k in FACTORS}
    same = rows.groupby("question_id").same_tokens_as_baseline.all().reindex(frame.index)
    factors["same_text"] = float(same.mean())
    factors["same_text_interaction"] = float(np.exp(frame.interaction[same].mean())) if same.any() else math.nan
    return Interaction(point, lo, hi, len(logs), classify(lo, hi), prompts_to_settle(point, lo, hi, len(logs)), factors)


def drift(rows: pd.DataFrame) -> dict[str, float]:
    """fp32 plain tokens/s within one cell: median, min and max over its questions."""
    speed = per_question(rows).reference
    return {"median": float(speed.median()), "min": float(speed.min()), "max": float(speed.max())}


def job_drift(medians: dict[str, float]) -> float:
    """Spread of the cells' median fp32 plain tokens/s across a job: (max - min) / median."""
    values = np.array(list(medians.values()), dtype=float)
    return float((values.max() - values.min()) / np.median(values)) if len(values) else math.nan
