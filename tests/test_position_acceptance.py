"""Acceptance per draft position and the per-request acceptance histogram, from per-step records."""

from specdec.core.metrics import StepRecord, position_acceptance


def _step(depth: int, accepted: int) -> StepRecord:
    return StepRecord(drafted=depth, draft_depth=depth, accepted=accepted, bonus=accepted == depth,
                      draft_time_s=0.0, target_time_s=0.0, other_time_s=0.0)


def test_rate_at_each_position_is_conditional_on_the_ones_before():
    # Five chain(3) steps accepting 3, 0, 1, 2, 1 draft tokens and one chain(1) step accepting 1.
    # Position 1 was tried by all 6 steps, kept by 5 (all but the 0); position 2 was tried by the
    # depth-3 steps that kept position 1 (3, 1, 2, 1: 4 steps), kept by 2 (3 and 2); position 3 was
    # tried by those 2 and kept by 1 (the 3). Rates 5/6, 2/4, 1/2: not the unconditional 2/5 at depth 2.
    steps = [_step(3, 3), _step(3, 0), _step(3, 1), _step(3, 2), _step(3, 1), _step(1, 1)]
    tried, kept, histogram = position_acceptance(steps)
    assert tried == [6, 4, 2]
    assert kept == [5, 2, 1]
    assert histogram == [1, 3, 1, 1]  # accepted 0: one step; 1: three; 2: one; 3: one
    assert sum(histogram) == len(steps)


def test_no_draft_has_no_positions():
    assert position_acceptance([_step(0, 0), _step(0, 0)]) == ([], [], [2])
    assert position_acceptance([]) == ([], [], [0])
