"""Per-step records of one generation and the statistics derived from them (definitions: docs/library.md).

Owns MAL (1 + mean accepted draft tokens per step; the last step counts up to the first EOS), acceptance per depth and
the step-time split (target forward, draft = `propose` + `commit`, the rest). Knows nothing about models or drafters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    drafted: int  # draft nodes verified
    draft_depth: int  # deepest draft node
    accepted: int  # accepted draft tokens (bonus excluded)
    bonus: bool  # the step's last token was a bonus (not recovered) token
    draft_time_s: float  # the drafter's propose + commit
    target_time_s: float  # the target's verification forward
    other_time_s: float  # the rest of the step: request, mask, acceptance, rollback, records
    shape: str = ""  # the shape drafted ("" = no draft was asked for)
    proposed: int = 0  # draft nodes the drafter proposed (before the policy trimmed them to `drafted`)
    commit_time_s: float = 0.0  # the part of draft_time_s spent in the drafter's commit

    @property
    def verify_time_s(self) -> float:
        """Everything but drafting: target forward + the rest."""
        return self.target_time_s + self.other_time_s


@dataclass
class GenerationStats:
    """Statistics of one generation (or, via `merge`, of several)."""

    steps: list[StepRecord] = field(default_factory=list)
    new_tokens: int = 0  # Tokens returned (after truncation at EOS / max_new_tokens).
    prefill_time_s: float = 0.0
    wall_time_s: float = 0.0  # Prefill plus every step, as timed by the loop.

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def mean_accepted_tokens(self) -> float:
        """Mean accepted draft tokens per step, bonus/recovered token excluded."""
        return sum(s.accepted for s in self.steps) / max(1, len(self.steps))

    @property
    def mean_acceptance_length(self) -> float:
        """MAL: mean tokens committed per target forward = 1 + mean_accepted_tokens."""
        return 1.0 + self.mean_accepted_tokens

    @property
    def mean_drafted(self) -> float:
        return sum(s.drafted for s in self.steps) / max(1, len(self.steps))

    @property
    def draft_time_s(self) -> float:
        return sum(s.draft_time_s for s in self.steps)

    @property
    def verify_time_s(self) -> float:
        """Everything but drafting (target forward + other), summed over steps."""
        return sum(s.verify_time_s for s in self.steps)

    @property
    def target_time_s(self) -> float:
        return sum(s.target_time_s for s in self.steps)

    @property
    def other_time_s(self) -> float:
        return sum(s.other_time_s for s in self.steps)

    def time_split(self) -> dict[str, float]:
        """Fractions of the summed step time: {"target", "draft", "other"} (sum 1; zeros if no steps)."""
        total = self.target_time_s + self.draft_time_s + self.other_time_s
        if total <= 0:
            return {"target": 0.0, "draft": 0.0, "other": 0.0}
        return {"target": self.target_time_s / total, "draft": self.draft_time_s / total,
                "other": self.other_time_s / total}

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second of decoding (prefill excluded)."""
        decode = self.wall_time_s - self.prefill_time_s
        return self.new_tokens / decode if decode > 0 else 0.0

    def acceptance_counts_by_depth(self) -> tuple[list[int], list[int]]:
        """(reached, accepted) for depth d = 1..D: steps whose draft reached depth d, and among them
        those whose accepted path reached d. Counts, so rates can be pooled over generations."""
        depth = max((s.draft_depth for s in self.steps), default=0)
        reached = [sum(s.draft_depth >= d for s in self.steps) for d in range(1, depth + 1)]
        accepted = [sum(s.draft_depth >= d and s.accepted >= d for s in self.steps) for d in range(1, depth + 1)]
        return reached, accepted

    def acceptance_rate_by_depth(self) -> list[float]:
        """Entry d-1: P(accepted path reaches depth d | the draft reached depth d)."""
        reached, accepted = self.acceptance_counts_by_depth()
        return [a / r for a, r in zip(accepted, reached)]

    def summary(self) -> dict:
        """Plain-number summary (JSON-ready)."""
        return {
            "new_tokens": self.new_tokens,
            "steps": self.num_steps,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "mean_drafted": self.mean_drafted,
            "acceptance_rate_by_depth": self.acceptance_rate_by_depth(),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "target_time_s": self.target_time_s,
            "other_time_s": self.other_time_s,
            "time_split": self.time_split(),
            "prefill_time_s": self.prefill_time_s,
            "wall_time_s": self.wall_time_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }

    def __repr__(self) -> str:
        split = self.time_split()
        return (f"GenerationStats({self.new_tokens} tokens in {self.num_steps} steps, "
                f"MAL {self.mean_acceptance_length:.2f}, {self.tokens_per_s:.1f} tokens/s, "
                f"step time: target {split['target']:.0%} / draft {split['draft']:.0%} / "
                f"other {split['other']:.0%})")

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "steps": [asdict(s) for s in self.steps]}

    @staticmethod
    def merge(stats: list[GenerationStats]) -> GenerationStats:
        """Pool several generations (steps concatenated, times and tokens summed)."""
        return GenerationStats(
            steps=[s for st in stats for s in st.steps],
            new_tokens=sum(st.new_tokens for st in stats),
            prefill_time_s=sum(st.prefill_time_s for st in stats),
            wall_time_s=sum(st.wall_time_s for st in stats),
        )


@dataclass
class BatchStats:
    """Statistics of one batch (`specdec.generate_batch`): the batch's steps and wall time, and each
    row's MAL. Per-row records are in each row's `GenerationStats` (their times are the batch step's)."""

    rows: int
    steps: int = 0
    new_tokens: int = 0  # Tokens returned over all rows.
    prefill_time_s: float = 0.0
    wall_time_s: float = 0.0
    target_time_s: float = 0.0
    draft_time_s: float = 0.0
    step_time_s: float = 0.0
    row_mal: list[float] = field(default_factory=list)  # Each row's mean acceptance length, in prompt order.
    verify_widths: dict[int, int] = field(default_factory=dict)
    """Steps per width of the batch's verify forward (1 + the most draft nodes of any active row: every
    row is padded to it), what a step costs on the batch's latency curve."""
    verify_shapes: dict[tuple[int, int], int] = field(default_factory=dict)
    """Steps per (rows still decoding, padded width): rows leave the batch when they finish, so a run's
    steps are not all as wide as the batch."""
    verify_shape_time_s: dict[tuple[int, int], float] = field(default_factory=dict)
    """Seconds of the verify forwards per (rows still decoding, padded width), summed: what a step of each
    shape cost in this run (a plain batch's one-token forward at each row count, for the cost model)."""

    def add_step(self, target_s: float, draft_s: float, total_s: float, rows: int = 1, width: int = 1) -> None:
        self.steps += 1
        self.verify_shape_time_s[rows, width] = self.verify_shape_time_s.get((rows, width), 0.0) + target_s
        self.target_time_s += target_s
        self.draft_time_s += draft_s
        self.step_time_s += total_s
        self.verify_widths[width] = self.verify_widths.get(width, 0) + 1
        self.verify_shapes[rows, width] = self.verify_shapes.get((rows, width), 0) + 1

    tokens_per_s = GenerationStats.tokens_per_s
    """Total new tokens (all rows) per second of wall time, prefill included."""
    decode_tokens_per_s = GenerationStats.decode_tokens_per_s

    def time_split(self) -> dict[str, float]:
        """Fractions of the summed step time: {"target", "draft", "other"}."""
        total = self.step_time_s
        if total <= 0:
            return {"target": 0.0, "draft": 0.0, "other": 0.0}
        return {"target": self.target_time_s / total, "draft": self.draft_time_s / total,
                "other": max(0.0, total - self.target_time_s - self.draft_time_s) / total}

    def summary(self) -> dict:
        return {"rows": self.rows, "steps": self.steps, "new_tokens": self.new_tokens,
                "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "prefill_time_s": self.prefill_time_s, "wall_time_s": self.wall_time_s,
                "time_split": self.time_split(), "row_mal": self.row_mal,
                "verify_widths": dict(sorted(self.verify_widths.items())),
                "verify_shapes": {f"{r}x{w}": n for (r, w), n in sorted(self.verify_shapes.items())}}


def position_acceptance(steps: list[StepRecord]) -> tuple[list[int], list[int], list[int]]:
    """(tried, kept, histogram) of a run's steps, counts that pool over runs: tried[i-1] = steps whose draft
    reached position i with 1..i-1 accepted, kept[i-1] = those that accepted i too, histogram[k] = steps
    that accepted k. E.g. accepted 2, 0, 1 of depth-3 drafts: [3, 2, 1], [2, 1, 0], [1, 1, 1, 0]."""
    depth = max((s.draft_depth for s in steps), default=0)
    tried = [sum(s.draft_depth >= i and s.accepted >= i - 1 for s in steps) for i in range(1, depth + 1)]
    kept = [sum(s.draft_depth >= i and s.accepted >= i for s in steps) for i in range(1, depth + 1)]
    histogram = [sum(s.accepted == k for s in steps) for k in range(depth + 1)]
    return tried, kept, histogram
