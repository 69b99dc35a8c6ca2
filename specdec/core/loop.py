"""The one speculative decoding loop: draft -> verify -> accept -> commit.

Owns `generate`, input validation, the target's KV cache for one generation (created here, rolled
back here, nowhere else) and the per-step records. Plain autoregressive decoding (drafter None) is
the same loop with no draft. Knows nothing about how a drafter builds its draft or how acceptance is
decided beyond calling `acceptance.verify`; imports no drafter and keeps no drafter state: every drafter
hears the same `drafter.commit(Step)` after the prefill and after each verification.

State between steps (design): the target's cache holds every committed token except the last one,
the *root*. Each step forwards [root, draft nodes...] in one tree forward, so row 0 of the logits
is the target's distribution after the root and row i+1 the one after draft node i.

The shape each step drafts comes from a `specdec.core.policy` policy (a fixed shape, or `auto`, which may
also choose to draft nothing), and the policy's `trim` picks the part of the proposal to verify
(`auto` drops the nodes that do not pay; a fixed shape keeps all). A step that asks for no draft
(the policy chose none, or only one token remains) does not call `drafter.propose`; the drafter
still hears the step's `commit`. Every step is timed in three parts (target forward / drafter
`propose` + `commit` / everything else, the policy included); on CUDA the loop synchronizes at
those boundaries so the split is honest (three syncs per step, beside the accepted path's).

The target's cache and the forward that writes it come as a pair (`specdec.target.forwards.CACHES`); the
prefill always runs through `Target.forward`, the steps through the pair's forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core import tree as tree_ops
from specdec.core.policy import FixedShape, ShapePolicy, shape_policy
from specdec.target.cache import Cache
from specdec.core.draft import Draft, Drafter, DraftRequest, Step
from specdec.target.forwards import CACHES, resolve_cache, verification_width
from specdec.core.metrics import GenerationStats, StepRecord
from specdec.target.model import Target
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import ShapeSpec, parse_shape
from specdec.core.acceptance import verify


@dataclass
class GenerationOutput:
    token_ids: list[int]
    """New tokens only (the EOS token, when generation stopped on it, included)."""
    text: str
    """Decoded `token_ids` (special tokens skipped)."""
    prompt_ids: list[int]
    stats: GenerationStats


def _no_sync() -> None:
    """Host and device are one (CPU): nothing to wait for."""


def prefill(target: Target, cache: Cache, token_ids: Sequence[int]) -> Step:
    """Run every token but the last (the root of the first step) into an empty `cache`; returns the
    prefill `Step` a drafter's `commit` takes. Also how tests and tools start a drafter at a prefix."""
    count = len(token_ids) - 1
    if count:
        out = target.prefill(token_ids[:-1], cache)
        hidden, aux = out.hidden, out.aux  # [B, L-1, H], [B, L-1, kH] or None
    else:
        hidden = torch.empty(1, 0, target.hidden_size, dtype=target.dtype, device=target.device)
        aux = hidden.new_empty(1, 0, target.hidden_size * len(target.aux_layers)) if target.aux_layers else None
    return Step(
        token_ids=torch.tensor([list(token_ids)], dtype=torch.long), num_new=[len(token_ids)],
        draft=Draft.empty(), acceptances=[], positions=torch.arange(count)[None], target_hidden=hidden,
        target_aux=aux, _kv=lambda: cache.tail(count),
    )


def generate(
    target: Target,
    drafter: Drafter | None,
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    shape: str | ShapeSpec | ShapePolicy = "chain(4)",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = True,
    stop_on_eos: bool = True,
    cache: str = "auto",
    cache_capacity: int | None = None,
    buckets: Sequence[int] | None = None,
) -> GenerationOutput:
    """Generate from `target`, drafting with `drafter` (None = plain autoregressive decoding).

    At temperature 0 the tokens equal the target's greedy decoding; at temperature > 0 they are
    distributed as the target's sampling distribution (after top-k / top-p). `prompt` is a string
    (chat template applied for chat models unless chat=False), chat messages, or token ids.
    `shape` is a concrete shape (`chain(4)`, `tree(4,2)`, `dynamic(...)`), `auto`
    (`specdec.core.policy`), or a `ShapePolicy` object (how `specdec.measure.profiles` records drafts).
    `cache` is `auto` or a key of `CACHES`; `cache_capacity` sizes a preallocated cache (default:
    just enough); `buckets` are the verification widths of `cache="graphs"` (default
    `specdec.target.graphs.DEFAULT_BUCKETS`, widened to the shape's largest draft when needed).
    """
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    prompt_ids = target.encode_prompt(prompt, chat=chat)
    policy, kind, needed, buckets = _plan(target, drafter, shape, len(prompt_ids), max_new_tokens, cache,
                                          cache_capacity, buckets)
    hear = drafter.commit if drafter is not None else _no_commit
    eos = target.eos_token_ids if stop_on_eos else set()
    generator = torch.Generator(device=target.device).manual_seed(seed)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else _no_sync
    stats = GenerationStats()
    start = time.perf_counter()

    # Prefill every prompt token but the last, which becomes the root of the first step.
    cache, forward = CACHES[kind](target, cache_capacity or needed, buckets)
    committed = list(prompt_ids)
    if drafter is not None:
        drafter.reset()
    first = prefill(target, cache, committed)
    hear(first)
    token_ids = first.token_ids  # [B, L] the committed tokens, rebuilt once per step at commit
    stats.prefill_time_s = time.perf_counter() - start

    while len(committed) - len(prompt_ids) < max_new_tokens:
        remaining = max_new_tokens - (len(committed) - len(prompt_ids))
        # 1. Draft (the policy's shape; none, or nodes deeper than remaining - 1, are useless).
        t0 = time.perf_counter()
        step_shape = policy.choose(len(committed)) if remaining > 1 else None
        tc = time.perf_counter()
        draft = Draft.empty()
        if step_shape is not None:
            draft = drafter.propose(DraftRequest(token_ids=token_ids, shape=step_shape, sampling=sampling,
                                                 generator=generator, max_depth=remaining - 1))
        if draft.depth > remaining - 1:
            draft = draft.subtree(tree_ops.prune_to_depth(draft.parents, remaining - 1))
        sync()
        proposed, tp = draft.num_nodes, time.perf_counter()
        draft = policy.trim(draft, len(committed))  # the part worth verifying (auto), else all of it

        # 2. Verify: one tree forward of [root, draft nodes] (root = block index 0).
        t1 = time.perf_counter()
        past = cache.next_position
        tokens = torch.cat([draft.tokens.new_tensor([[committed[-1]]]), draft.tokens], 1)  # [B, 1 + N]
        parents = torch.cat([torch.tensor([-1]), draft.parents + 1])  # draft roots hang off block 0
        out = forward(tokens, cache, parents)
        sync()
        t2 = time.perf_counter()

        # 3. Accept.
        acceptance = verify(draft, out.logits, sampling, generator)

        # 4. Commit: keep the root and the accepted path in the cache, append the new tokens, and
        #    tell the drafter (its rollback and whatever target state it reads).
        kept = [0] + [i + 1 for i in acceptance.path]
        cache.keep(past, kept)
        draft_tokens = draft.tokens[0].tolist()
        new = [draft_tokens[i] for i in acceptance.path] + [acceptance.next_token]
        committed.extend(new)
        token_ids = torch.tensor([committed], dtype=torch.long)
        t3 = time.perf_counter()
        hear(Step(
            token_ids=token_ids, num_new=[len(new)], draft=draft,
            acceptances=[acceptance], positions=torch.arange(past, past + len(kept))[None],
            target_hidden=out.hidden[:, kept], target_aux=None if out.aux is None else out.aux[:, kept],
            _kv=lambda n=len(kept): cache.tail(n),
        ))
        sync()
        t4 = time.perf_counter()
        record = StepRecord(
            drafted=draft.num_nodes, draft_depth=draft.depth, accepted=acceptance.num_accepted,
            bonus=acceptance.bonus, draft_time_s=(tp - tc) + (t4 - t3), target_time_s=t2 - t1, other_time_s=0.0,
            shape="" if step_shape is None else str(step_shape), proposed=proposed, commit_time_s=t4 - t3,
        )
        record.other_time_s = time.perf_counter() - t0 - record.draft_time_s - record.target_time_s
        t5 = time.perf_counter()
        policy.observe(draft, acceptance, record, len(committed))
        record.other_time_s += time.perf_counter() - t5
        stats.steps.append(record)
        if eos and eos.intersection(new):
            break

    new_ids = _cut_at_eos(committed[len(prompt_ids):][:max_new_tokens], eos)
    stats.new_tokens = len(new_ids)
    stats.wall_time_s = time.perf_counter() - start
    return GenerationOutput(token_ids=new_ids, text=target.decode(new_ids), prompt_ids=prompt_ids, stats=stats)


def _plan(target: Target, drafter: Drafter | None, shape: str | ShapeSpec | ShapePolicy, prompt_len: int,
          max_new_tokens: int, cache: str, cache_capacity: int | None, buckets: Sequence[int] | None,
          ) -> tuple[ShapePolicy, str, int, tuple[int, ...] | None]:
    """Check the inputs before any work and size the cache: (the shape policy, the cache kind, the
    capacity the generation needs, the width buckets). ValueError for a bad shape or `max_new_tokens`,
    a prompt + generation past the context, or a too short `cache_capacity`."""
    spec = None if isinstance(shape, ShapePolicy) else parse_shape(shape)
    kind = resolve_cache(cache, target)
    max_nodes = 0 if drafter is None else shape.max_nodes if spec is None else spec.max_nodes
    width, buckets = verification_width(kind, max_nodes + 1, buckets)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > target.context_length:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens} exceeds the context length of {target.label!r} "
            f"({target.context_length}); shorten the prompt or lower max_new_tokens"
        )
    needed = prompt_len + max_new_tokens + width - 1
    if cache_capacity is not None and cache_capacity < needed:
        padded = f", padded to bucket {width}" if kind == "graphs" else ""
        raise ValueError(f"cache_capacity={cache_capacity} is too short: prompt ({prompt_len}) + "
                         f"max_new_tokens ({max_new_tokens}) + draft nodes ({width - 1}{padded}) = {needed}")
    policy = FixedShape(None) if drafter is None else shape if spec is None else shape_policy(
        spec, target, drafter, cache=kind)
    return policy, kind, needed, buckets


def _cut_at_eos(new_ids: list[int], eos: set[int]) -> list[int]:
    """The generated tokens up to and including the first EOS (all of them if none)."""
    stop = next((i for i, t in enumerate(new_ids) if t in eos), None)
    return new_ids if stop is None else new_ids[: stop + 1]


def _no_commit(step: Step) -> None:
    """Plain decoding (no drafter): nobody to tell."""
