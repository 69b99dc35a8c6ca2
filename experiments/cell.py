"""One matched cell: a drafter, a shape and a target, against the plain loop on the same target and
against the plain loop on the unquantized reference target.

Owns the measuring protocol. For every question and turn, up to three runs decode the same prompt
with the same seed and the same `max_new_tokens`, one right after the other in this process, their
order rotating from prompt to prompt so that drift hits each alike:
- *drafted*: `specdec.generate(target, drafter, ...)`;
- *plain*: `specdec.generate(target, None, ...)`, the same (possibly quantized) target;
- *reference*: the plain loop on the unquantized target (`reference`; when the cell's target is the
  unquantized one, the plain run is the reference and no third run is made).
So each of the cell's three speedups is a ratio of runs measured side by side: plain / reference
(quantization alone), drafted / plain (speculation alone), drafted / reference (the compound).
Turn 1 is the question's text (the target's chat template applied by `generate`); turn i > 1 is the
chat so far, where the assistant's messages are the plain loop's own earlier answers, so the drafted
and plain runs see the same tokens (the reference, a different model at T = 0 too, sees them as well).
Returns plain dict rows; knows nothing about Hydra or where rows are stored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import specdec

from experiments.questions import Question

RUNS = ("drafted", "plain", "reference")


def _ratio(numerator: specdec.GenerationOutput, denominator: specdec.GenerationOutput) -> float:
    """tokens/s of `numerator` over tokens/s of `denominator`."""
    base = denominator.stats.tokens_per_s
    return numerator.stats.tokens_per_s / base if base > 0 else float("nan")


def _row(drafted: specdec.GenerationOutput, plain: specdec.GenerationOutput,
         reference: specdec.GenerationOutput) -> dict[str, Any]:
    stats, base, ref = drafted.stats, plain.stats, reference.stats
    reached, accepted = stats.acceptance_counts_by_depth()
    widths = Counter(s.drafted + 1 for s in stats.steps)  # verify width = root + draft nodes
    return {
        "prompt_tokens": len(drafted.prompt_ids),
        "new_tokens": stats.new_tokens,
        "steps": stats.num_steps,
        "accepted_tokens": sum(s.accepted for s in stats.steps),
        "mal": stats.mean_acceptance_length,
        "mean_accepted_tokens": stats.mean_accepted_tokens,
        "mean_drafted": stats.mean_drafted,
        "verify_widths": {str(w): n for w, n in sorted(widths.items())},
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
        "baseline_steps": base.num_steps,
        "baseline_verify_time_s": base.verify_time_s,
        "baseline_prefill_time_s": base.prefill_time_s,
        "baseline_wall_time_s": base.wall_time_s,
        "baseline_tokens_per_s": base.tokens_per_s,
        "baseline_decode_tokens_per_s": base.decode_tokens_per_s,
        "reference_new_tokens": ref.new_tokens,
        "reference_steps": ref.num_steps,
        "reference_verify_time_s": ref.verify_time_s,
        "reference_prefill_time_s": ref.prefill_time_s,
        "reference_wall_time_s": ref.wall_time_s,
        "reference_tokens_per_s": ref.tokens_per_s,
        "speedup": _ratio(drafted, plain),
        "speedup_quant": _ratio(plain, reference),
        "speedup_compound": _ratio(drafted, reference),
        "same_tokens_as_baseline": drafted.token_ids == plain.token_ids,
        "same_tokens_as_reference": plain.token_ids == reference.token_ids,
    }


def run_cell(
    target: specdec.Target,
    drafter: specdec.drafters.Drafter,
    questions: list[Question],
    *,
    shape: str,
    sampling: specdec.SamplingConfig,
    max_new_tokens: int,
    reference: specdec.Target | None = None,
    warmup_tokens: int = 0,
    on_turn: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure `drafter` against the plain loop on every turn of `questions`; one row per turn.

    Question i uses seed `sampling.seed + i` for every run. `reference` is the unquantized target
    (None: `target` is the reference itself, and its plain run is reused). `on_turn` is called after
    each turn (progress reporting).
    """
    options = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
               "max_new_tokens": max_new_tokens}
    runs = RUNS if reference is not None else RUNS[:2]

    def decode(run: str, prompt, seed: int, **override) -> specdec.GenerationOutput:
        model = reference if run == "reference" else target
        return specdec.generate(model, drafter if run == "drafted" else None, prompt, shape=shape,
                                seed=seed, **{**options, **override})

    if warmup_tokens > 0 and questions:
        for run in runs:
            decode(run, questions[0].turns[0], sampling.seed, max_new_tokens=warmup_tokens)

    rows = []
    for index, question in enumerate(questions):
        seed = sampling.seed + index
        history: list[dict[str, str]] = []
        for turn, text in enumerate(question.turns):
            prompt = text if turn == 0 else [*history, {"role": "user", "content": text}]
            shift = (index + turn) % len(runs)  # rotate which run goes first
            order = runs[shift:] + runs[:shift]
            outputs = {run: decode(run, prompt, seed) for run in order}
            outputs.setdefault("reference", outputs["plain"])
            history = [*history, {"role": "user", "content": text},
                       {"role": "assistant", "content": outputs["plain"].text}]
            rows.append({
                "question_id": question.question_id,
                "category": question.category,
                "turn": turn + 1,
                "question_seed": seed,
                "order": ",".join(order),
                **_row(outputs["drafted"], outputs["plain"], outputs["reference"]),
            })
            if on_turn is not None:
                on_turn()
    return rows
