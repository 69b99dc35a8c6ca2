"""What the loop tells the world after each step: `StepEvent`, and its per-phase times (`PhaseTimes`).

An event is frozen, its lists are the loop's for this step only, and `logits` is a view valid until the loop resumes;
`rows[b]` is the prompt index of active batch row b. Knows nothing about how a step is run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.draft import Acceptance, Draft
from specdec.core.shapes import Shape


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds of one step's phases, shared by its rows (one batch forward serves them all)."""

    choose: float  # The shape policy: observing the last step, choosing this one's shape, trimming the proposals.
    propose: float  # The drafter's `propose` / `propose_batch`.
    forward: float  # Building the verification block and the target's one tree forward.
    accept: float  # Acceptance per row, the target cache's rollback and the committed tokens' bookkeeping.
    commit: float  # The drafter's `commit`.

    @property
    def total(self) -> float:
        return self.choose + self.propose + self.forward + self.accept + self.commit


@dataclass(frozen=True)
class StepEvent:
    """One step of `decode`: per active row, what was drafted, verified, decided and committed."""

    index: int  # Steps before this one (0 = the first after the prefill).
    rows: list[int]  # Prompt index of each active batch row.
    shape: Shape | None  # The concrete shape the policy chose (None: no draft was asked for).
    proposals: list[Draft]  # Per row, the drafter's proposal as drafted.
    drafts: list[Draft]
    """Per row, the draft as verified: the proposal pruned to the row's remaining depth and trimmed by
    the policy (`kept`)."""
    kept: list[torch.Tensor | None]  # Per row, the proposal's node indices the policy kept (ascending; None = all).
    acceptances: list[Acceptance]  # Per row, the acceptance rule's decision on the target's logits.
    paths: list[list[int]]
    """Per row, the draft nodes committed (their cache entries kept): the accepted path, or under
    `force` the longest path that matched the forced tokens."""
    committed: list[list[int]]
    """Per row, the tokens committed this step: those of `paths`, then the next token (under `force`, the forced ones,
    which may differ from `acceptances`); token j was decided on logits row ([0] + [n + 1 for n in path])[j]. A row's
    output cuts them at its first stop token and its `max_new_tokens`."""
    done: list[bool]  # Per row, whether the row finished with this step (a stop token, or its `max_new_tokens`).
    logits: torch.Tensor
    """[B, W, V] the target's logits of the verification block: row 0 after the root, row i + 1 after
    draft node i (padding past a row's draft). A view: valid until the loop resumes."""
    contexts: list[int]  # Per row, tokens committed before this step (prompt included).
    width: int  # Tokens per row in the verification forward (root + the widest draft).
    times: PhaseTimes
    start_s: float  # Seconds from the start of `decode` (before the prefill) to this step's start.
