"""One paired cell: a drafter and a shape on a kernel, in a 2x2 against the unquantized reference.

Owns the measuring protocol (experiments/README.md): per turn, drafted and plain on the kernel and on fp32, back to
back in a balanced order (`ORDERS`), teacher-forced acceptance, a chain(K) cell's replays and drafting probe, and
batches. Returns plain dict rows; knows nothing about Hydra or the store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

import specdec
from specdec.core.metrics import BatchStats, position_acceptance
from specdec.core.shapes import ChainShape, parse_shape
from specdec.measure.profiles import AcceptanceProfile, profile
from specdec.runtime.forwards import CACHES

from experiments.questions import Question

RUNS = ("drafted", "plain", "reference", "reference_drafted")
PREFIXES = ("", "baseline_", "reference_", "reference_drafted_")  # Each run's key prefix in a row, in `RUNS` order.
ORDERS = ((0, 1, 2, 3), (1, 3, 0, 2), (3, 2, 1, 0), (2, 0, 3, 1))
"""The four runs' orders, prompt by prompt (indices into RUNS). Within each row a Williams square: every run is in every
position once and follows every other run once per four prompts. Across rows too: the prompts run back to back, so a
row's first run follows the previous row's last, and the sequence of 16 runs (cyclic; the warm-up ends as the last row
does) is unchanged by swapping the kernel's runs with the reference's (drafted <-> reference_drafted, plain <->
reference) in every run's position and predecessor. A carry-over from one run to the next, or a drift with position,
then biases the kernel's speculation and the reference's alike and cancels in the interaction."""
PROBE_TOKENS = 32
PROBE_REPEATS = 3  # The drafting probe (module docstring): new tokens per run and runs per depth.
_PROFILES: dict[tuple, tuple[object, AcceptanceProfile]] = {}
"""(reference drafter id, shape, prompt, max_new_tokens) -> (that drafter, its fp32 profile): shared by
the cells of a process (the drafter is kept so its id cannot be reused by another)."""


def _ratio(numerator: specdec.GenerationOutput, denominator: specdec.GenerationOutput) -> float:
    """tokens/s of `numerator` over tokens/s of `denominator`."""
    base = denominator.stats.tokens_per_s
    return numerator.stats.tokens_per_s / base if base > 0 else float("nan")


def _run_fields(prefix: str, out: specdec.GenerationOutput) -> dict[str, Any]:
    """What the cost model and the statistics read from one run, keys prefixed by `prefix`."""
    stats = out.stats
    widths = Counter(s.drafted + 1 for s in stats.steps)  # verify width = root + draft nodes
    return {f"{prefix}new_tokens": stats.new_tokens, f"{prefix}steps": stats.num_steps,
            f"{prefix}accepted_tokens": sum(s.accepted for s in stats.steps),
            f"{prefix}verify_widths": {str(w): n for w, n in sorted(widths.items())},
            f"{prefix}draft_time_s": stats.draft_time_s, f"{prefix}verify_time_s": stats.verify_time_s,
            f"{prefix}prefill_time_s": stats.prefill_time_s, f"{prefix}wall_time_s": stats.wall_time_s,
            f"{prefix}tokens_per_s": stats.tokens_per_s, f"{prefix}decode_tokens_per_s": stats.decode_tokens_per_s}


def _row(out: dict[str, specdec.GenerationOutput]) -> dict[str, Any]:
    drafted, plain, reference, ref_drafted = (out[r] for r in RUNS)
    stats = drafted.stats
    reached, accepted = stats.acceptance_counts_by_depth()
    speculation, reference_speculation = _ratio(drafted, plain), _ratio(ref_drafted, reference)
    return {
        "prompt_tokens": len(drafted.prompt_ids),
        "mal": stats.mean_acceptance_length,
        "mean_accepted_tokens": stats.mean_accepted_tokens,
        "mean_drafted": stats.mean_drafted,
        "acceptance_by_depth": stats.acceptance_rate_by_depth(),
        "reached_by_depth": reached,
        "accepted_by_depth": accepted,
        **dict(zip(("position_tried", "position_kept", "accept_histogram"), position_acceptance(stats.steps))),
        "accept_lengths": [s.accepted + 1 for s in stats.steps],  # Spec-Bench's per-step field
        "text": drafted.text,
        **{k: v for prefix, run in zip(PREFIXES, (drafted, plain, reference, ref_drafted))
           for k, v in _run_fields(prefix, run).items()},
        "reference_mal": ref_drafted.stats.mean_acceptance_length,
        "speedup": speculation,
        "speedup_quant": _ratio(plain, reference),
        "speedup_compound": _ratio(drafted, reference),
        "speedup_reference": reference_speculation,
        "interaction": speculation / reference_speculation if reference_speculation > 0 else float("nan"),
        "paired": True,
        "same_tokens_as_baseline": drafted.token_ids == plain.token_ids,
        "same_tokens_as_reference": plain.token_ids == reference.token_ids,
    }


def _batch_output(outs: specdec.BatchOutput) -> specdec.GenerationOutput:
    """A batch's runs as one output: every row's tokens and steps, the batch's wall and prefill time."""
    stats = specdec.GenerationStats.merge([o.stats for o in outs])
    stats.wall_time_s, stats.prefill_time_s = outs.stats.wall_time_s, outs.stats.prefill_time_s
    return specdec.GenerationOutput(token_ids=[t for o in outs for t in o.token_ids], text="\n".join(o.text for o in outs),
                                    prompt_ids=[t for o in outs for t in o.prompt_ids], stats=stats)


def _batch_fields(prefix: str, stats: BatchStats) -> dict[str, Any]:
    """What the cost model reads of one batched run, per batch step: steps per padded width and per (rows, width) "RxW",
    forward seconds per such shape, and everything but drafting summed over steps."""
    return {f"{prefix}batch_steps": stats.steps,
            f"{prefix}batch_verify_widths": {str(w): n for w, n in sorted(stats.verify_widths.items())},
            f"{prefix}batch_verify_shapes": {f"{r}x{w}": n for (r, w), n in sorted(stats.verify_shapes.items())},
            f"{prefix}batch_shape_forward_s": {f"{r}x{w}": s
                                                for (r, w), s in sorted(stats.verify_shape_time_s.items())},
            f"{prefix}batch_verify_time_s": stats.step_time_s - stats.draft_time_s}


def _run_batches(model_of: dict, runs: tuple[str, ...], questions: list[Question], batch: int, shape: str,
                 seed: int, options: dict, on_unit: Callable[[int], None] | None) -> list[dict[str, Any]]:
    """`run_cell` at `batch` > 1: one row per group of `batch` questions' first turns."""
    rows = []
    for group, start in enumerate(range(0, len(questions), batch)):
        members = questions[start:start + batch]
        prompts = [q.turns[0] for q in members]
        order = run_order(runs, group)
        batches = {}
        for run in order:
            model, draft = model_of[run]
            batches[run] = specdec.generate_batch(model, draft, prompts, shape=shape, seed=seed + start, **options)
        batches.setdefault("reference", batches["plain"])
        batches.setdefault("reference_drafted", batches["drafted"])
        outputs = {run: _batch_output(out) for run, out in batches.items()}
        per_step = {k: v for run, prefix in zip(RUNS, PREFIXES)
                    for k, v in _batch_fields(prefix, batches[run].stats).items()}
        rows.append({"question_id": "+".join(q.question_id for q in members), "category": "batch", "turn": 1,
                     "question_seed": seed + start, "order": ",".join(order), "rows": len(members), **_row(outputs),
                     **per_step})
        if on_unit is not None:
            on_unit(len(members))
    return rows


@torch.inference_mode()
def teacher_forced(fp32: AcceptanceProfile, target: specdec.Target, shape: str) -> dict[str, Any]:
    """Acceptance of the fp32 profile's drafts against `target`'s argmax after each prefix of the
    fp32 continuation: the simulated MAL in `shape` and the per-depth counts (see the module docstring)."""
    ids = [*fp32.prompt_ids, *fp32.greedy]
    cache, _ = CACHES["dynamic"](target, len(ids), ())
    logits = target.forward(torch.tensor([ids[:-1]], dtype=torch.long), cache).logits  # [1, P + N - 1, V]
    argmax = logits[0, len(fp32.prompt_ids) - 1:].argmax(-1).tolist()  # [N]: the token after each prefix
    forced = replace(fp32, greedy=argmax)
    counts = forced.counts()
    out = {"tf_mal": forced.simulate(shape), "tf_reached_by_depth": counts.reached,
           "tf_accepted_by_depth": counts.accepted}
    chain = parse_shape(shape)
    if isinstance(chain, ChainShape):
        replays = [forced.accepted_per_step(ChainShape(k)) for k in range(1, chain.k + 1)]
        out |= {"tf_chain_steps": [len(steps) for steps in replays],
                "tf_chain_accepted": [sum(steps) for steps in replays],
                "tf_accepted_depth": [len(forced.accepted_at(p, d)) for p, d in enumerate(forced.drafts)]}
    return out


def drafting_probe(pairs: Sequence[tuple[specdec.Target, specdec.drafters.Drafter]], prompt, depth: int, seed: int,
                   options: dict) -> list[dict[str, float]]:
    """Per (target, drafter) of `pairs`: {str(d): median drafting seconds of a step drafting d nodes} for d in (1,
    `depth`), from `PROBE_REPEATS` alternating chain(d) runs on `prompt`; a depth no step drafted in full is left
    out."""
    times: list[dict[int, list[float]]] = [{1: [], depth: []} for _ in pairs]
    for repeat in range(PROBE_REPEATS):
        for d in ((1, depth) if repeat % 2 == 0 else (depth, 1)):
            for i in range(len(pairs)) if repeat % 2 == 0 else reversed(range(len(pairs))):
                target, drafter = pairs[i]
                out = specdec.generate(target, drafter, prompt, shape=ChainShape(d), seed=seed,
                                       **{**options, "max_new_tokens": PROBE_TOKENS})
                times[i][d] += [s.draft_time_s for s in out.stats.steps if s.drafted == d]
    return [{str(d): float(torch.tensor(t).median()) for d, t in each.items() if t} for each in times]


def run_order(runs: tuple[str, ...], k: int) -> list[str]:
    """The order of `runs` for the k-th prompt: a Williams square row for the four paired runs
    (`ORDERS`), alternating for two runs (a reference cell)."""
    if len(runs) == len(RUNS):
        return [runs[i] for i in ORDERS[k % len(ORDERS)]]
    shift = k % len(runs)
    return list(runs[shift:] + runs[:shift])


def run_cell(
    target: specdec.Target,
    drafter: specdec.drafters.Drafter,
    questions: list[Question],
    *,
    shape: str,
    sampling: specdec.SamplingConfig,
    max_new_tokens: int,
    reference: specdec.Target | None = None,
    reference_drafter: specdec.drafters.Drafter | None = None,
    warmup_tokens: int = 0,
    teacher_forcing: bool = False,
    on_unit: Callable[[int], None] | None = None,
    batch: int = 1,
) -> list[dict[str, Any]]:
    """Measure `drafter` on `target` in the paired 2x2 on every turn of `questions`; one row per turn.

    Question i uses seed `sampling.seed + i`. `reference` / `reference_drafter` = None: `target` is its
    own reference. `on_unit(turns)` is called after each turn's runs (a batch: each group's). With
    `teacher_forcing` (T = 0), a chain(K) cell (K >= 2) at batch 1 also runs the drafting probe."""
    if (reference is None) != (reference_drafter is None):
        raise ValueError("reference and reference_drafter go together: give both (a kernel cell) or neither")
    if teacher_forcing and sampling.temperature > 0:
        raise ValueError(f"teacher-forced acceptance is defined at T = 0 only, got T = {sampling.temperature}")
    options = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
               "max_new_tokens": max_new_tokens}
    runs = RUNS if reference is not None else RUNS[:2]
    model_of = {"drafted": (target, drafter), "plain": (target, None),
                "reference": (reference, None), "reference_drafted": (reference, reference_drafter)}
    fp32, fp32_drafter = (reference, reference_drafter) if reference is not None else (target, drafter)

    def decode(run: str, prompt, seed: int, **override) -> specdec.GenerationOutput:
        model, draft = model_of[run]
        return specdec.generate(model, draft, prompt, shape=shape, seed=seed, **{**options, **override})

    if warmup_tokens > 0 and questions:
        for run in run_order(runs, -1):  # the last row of ORDERS: the first prompt's runs follow it as any row does
            decode(run, questions[0].turns[0], sampling.seed, max_new_tokens=warmup_tokens)
    if batch > 1:
        return _run_batches(model_of, runs, questions, batch, shape, sampling.seed, options, on_unit)

    chain = parse_shape(shape)
    probe = {}
    if teacher_forcing and questions and isinstance(chain, ChainShape) and chain.k >= 2:
        pairs = [(target, drafter)] + ([(reference, reference_drafter)] if reference is not None else [])
        probes = drafting_probe(pairs, questions[0].turns[0], chain.k, sampling.seed, options)
        probe = {"draft_probe_s": probes[0], **({"reference_draft_probe_s": probes[1]} if len(probes) > 1 else {})}
    rows = []
    for index, question in enumerate(questions):
        seed = sampling.seed + index
        history: list[dict[str, str]] = []
        for turn, text in enumerate(question.turns):
            prompt = text if turn == 0 else [*history, {"role": "user", "content": text}]
            order = run_order(runs, len(rows))  # turns run back to back: the design's rows follow them
            outputs = {run: decode(run, prompt, seed) for run in order}
            outputs.setdefault("reference", outputs["plain"])
            outputs.setdefault("reference_drafted", outputs["drafted"])
            history = [*history, {"role": "user", "content": text},
                       {"role": "assistant", "content": outputs["plain"].text}]
            row = {"question_id": question.question_id, "category": question.category, "turn": turn + 1,
                   "question_seed": seed, "order": ",".join(order), **_row(outputs)}
            if teacher_forcing:
                key = (id(fp32_drafter), shape, str(prompt), max_new_tokens)
                if _PROFILES.get(key, (None,))[0] is not fp32_drafter:
                    _PROFILES[key] = (fp32_drafter, profile(fp32, fp32_drafter, prompt, shape=shape,
                                                            max_new_tokens=max_new_tokens))
                row.update(teacher_forced(_PROFILES[key][1], target, shape), **probe)
            rows.append(row)
            if on_unit is not None:
                on_unit(1)
    return rows
