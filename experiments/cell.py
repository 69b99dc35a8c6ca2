"""One matched cell: a drafter, a shape and a target, against the plain loop on the same target.

Owns the measuring protocol. For every question and turn, the drafted run and the plain loop
(`specdec.generate(target, None, ...)`) decode the same prompt with the same seed and the same
`max_new_tokens`, one right after the other in this process, their order alternating from prompt to
prompt, so each speedup is a ratio of two runs measured side by side. Turn 1 is the question's text
(the target's chat template applied by `generate`); turn i > 1 is the chat so far, where the
assistant's messages are the plain loop's own earlier answers, so both runs see the same tokens.
Returns plain dict rows; knows nothing about Hydra or where rows are stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import specdec

from experiments.questions import Question


def _row(drafted: specdec.GenerationOutput, baseline: specdec.GenerationOutput) -> dict[str, Any]:
    stats, base = drafted.stats, baseline.stats
    reached, accepted = stats.acceptance_counts_by_depth()
    return {
        "prompt_tokens": len(drafted.prompt_ids),
        "new_tokens": stats.new_tokens,
        "steps": stats.num_steps,
        "accepted_tokens": sum(s.accepted for s in stats.steps),
        "mal": stats.mean_acceptance_length,
        "mean_accepted_tokens": stats.mean_accepted_tokens,
        "mean_drafted": stats.mean_drafted,
        "acceptance_by_depth": stats.acceptance_rate_by_depth(),
        "reached_by_depth": reached,
        "accepted_by_depth": accepted,
        "draft_time_s": stats.draft_time_s,
        "verify_time_s": stats.verify_time_s,
        "prefill_time_s": stats.prefill_time_s,
        "wall_time_s": stats.wall_time_s,
        "tokens_per_s": stats.tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "baseline_new_tokens": base.new_tokens,
        "baseline_wall_time_s": base.wall_time_s,
        "baseline_tokens_per_s": base.tokens_per_s,
        "baseline_decode_tokens_per_s": base.decode_tokens_per_s,
        "speedup": stats.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else float("nan"),
        "same_tokens_as_baseline": drafted.token_ids == baseline.token_ids,
    }


def run_cell(
    target: specdec.Target,
    drafter: specdec.drafters.Drafter,
    questions: list[Question],
    *,
    shape: str,
    sampling: dict[str, Any],
    warmup_tokens: int = 0,
    on_turn: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure `drafter` against the plain loop on every turn of `questions`; one row per turn.

    `sampling` holds temperature, top_k, top_p, seed and max_new_tokens; question i uses seed
    `seed + i` for both runs. `on_turn` is called after each turn (progress reporting).
    """
    options = {k: sampling[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens")}

    def decode(with_drafter: bool, prompt, seed: int, **override) -> specdec.GenerationOutput:
        return specdec.generate(target, drafter if with_drafter else None, prompt, shape=shape,
                                seed=seed, **{**options, **override})

    if warmup_tokens > 0 and questions:
        for with_drafter in (False, True):
            decode(with_drafter, questions[0].turns[0], sampling["seed"], max_new_tokens=warmup_tokens)

    rows = []
    for index, question in enumerate(questions):
        seed = sampling["seed"] + index
        history: list[dict[str, str]] = []
        for turn, text in enumerate(question.turns):
            prompt = text if turn == 0 else [*history, {"role": "user", "content": text}]
            drafted_first = (index + turn) % 2 == 1
            outputs = {}
            for with_drafter in ((True, False) if drafted_first else (False, True)):
                outputs[with_drafter] = decode(with_drafter, prompt, seed)
            baseline = outputs[False]
            history = [*history, {"role": "user", "content": text}, {"role": "assistant", "content": baseline.text}]
            rows.append({
                "question_id": question.question_id,
                "category": question.category,
                "turn": turn + 1,
                "question_seed": seed,
                "order": "drafted_first" if drafted_first else "baseline_first",
                **_row(outputs[True], baseline),
            })
            if on_turn is not None:
                on_turn()
    return rows
