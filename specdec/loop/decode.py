"""The one speculative decoding loop: draft -> verify -> accept -> commit.

Owns `generate` and `generate_batch` (its batch of one is `generate`), input validation, the target's
KV cache for one generation (created here, rolled back here, nowhere else) and the per-step records;
the padding and per-row bookkeeping of a batch is in `specdec.loop.rows`. Plain autoregressive decoding (drafter None) is
the same loop with no draft. Knows nothing about how a drafter builds its draft or how acceptance is
decided beyond calling `acceptance.accept`; imports no drafter and keeps no drafter state: every drafter
hears the same `drafter.commit(Step)` after the prefill and after each verification.

State between steps (design): the target's cache holds every committed token except the last one,
the *root*. Each step forwards [root, draft nodes...] in one tree forward, so row 0 of the logits
is the target's distribution after the root and row i+1 the one after draft node i.

The shape each step drafts comes from a `specdec.loop.policy` policy (a fixed shape, or `auto`, which may
also choose to draft nothing), and the policy's `trim` picks the part of the proposal to verify
(`auto` drops the nodes that do not pay; a fixed shape keeps all). A step that asks for no draft
(the policy chose none, or only one token remains) does not call `drafter.propose`; the drafter
still hears the step's `commit`. Every step is timed in three parts (target forward / drafter
`propose` + `commit` / everything else, the policy included); on CUDA the loop synchronizes at
those boundaries so the split is honest (three syncs per step, beside the accepted path's).

The target's cache and the forward that writes it come as a pair (`specdec.runtime.forwards.CACHES`); the
prefill always runs through `Target.forward`, the steps through the pair's forward.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from specdec.core import tree as tree_ops
from specdec.loop.policy import FixedShape, ShapePolicy, shape_policy
from specdec.runtime.cache import Cache
from specdec.core.draft import Draft, Drafter, DraftRequest, Step
from specdec.runtime.forwards import CACHES, resolve_cache, verification_width
from specdec.core.metrics import BatchStats, GenerationStats, StepRecord
from specdec.runtime.model import Target
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import ShapeSpec, parse_shape
from specdec.core.acceptance import accept
from specdec.loop.rows import check_memory, commit_step, left_padded, prefill_rows, verify_block


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
    eos: Collection[int] | None = None,
    cache: str = "auto",
    cache_capacity: int | None = None,
    buckets: Sequence[int] | None = None,
) -> GenerationOutput:
    """Generate from `target`, drafting with `drafter` (None = plain autoregressive decoding).

    At temperature 0 the tokens equal the target's greedy decoding; at temperature > 0 they are
    distributed as the target's sampling distribution (after top-k / top-p). `prompt` is a string
    (chat template applied for chat models unless chat=False), chat messages, or token ids.
    `shape` is a concrete shape (`chain(4)`, `tree(4,2)`, `dynamic(...)`), `auto`
    (`specdec.loop.policy`), or a `ShapePolicy` object (how `specdec.measure.profiles` records drafts).
    `eos` is the stop set (None: the target's EOS tokens; ignored with stop_on_eos=False).
    `cache` is `auto` or a key of `CACHES`; `cache_capacity` sizes a preallocated cache (default:
    just enough); `buckets` are the verification widths of `cache="graphs"` (default
    `specdec.runtime.graphs.DEFAULT_BUCKETS`, widened to the shape's largest draft when needed).
    It is `generate_batch` with one prompt.
    """
    return generate_batch(target, drafter, [prompt], shape=shape, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, chat=chat,
                          stop_on_eos=stop_on_eos, eos=eos, cache=cache, cache_capacity=cache_capacity, buckets=buckets)[0]


class BatchOutput(list):
    """`generate_batch`'s result: one `GenerationOutput` per prompt, in order, plus `stats`."""

    stats: BatchStats


def generate_batch(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[str | Sequence[int] | Sequence[dict]],
    *,
    shape: str | ShapeSpec | ShapePolicy = "chain(4)",
    max_new_tokens: int | Sequence[int] = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    chat: bool = True,
    stop_on_eos: bool = True,
    eos: Collection[int] | None = None,
    cache: str = "auto",
    cache_capacity: int | None = None,
    buckets: Sequence[int] | None = None,
) -> BatchOutput:
    """`generate` for several prompts at once, through the same four phases: every step drafts each
    row (`BatchDrafter.propose_batch`), verifies all rows in one padded forward, accepts per row and
    commits per row (`Cache.keep_rows`). Rows accept different numbers of tokens, prompts may differ
    in length (right-padded prefill; shorter rows get holes, `specdec.runtime.cache`), and a row that
    finishes (EOS, its `max_new_tokens`) leaves the batch (`select_rows`) so it costs nothing after.

    Row b draws randomness only from its own generator, seeded `seed + b`: its output equals
    `generate(..., seed=seed + b)` on its prompt alone in law (and token for token at T = 0).
    `max_new_tokens` is one number or one per prompt. A drafter must be batchable for more than one
    prompt (`specdec.core.draft.BatchDrafter`). `shape="auto"` picks one shape per step for the whole
    batch, planning with the latency curve at the batch's size (`python -m specdec.tune --batch B`) and
    verifying each row's draft whole. `cache="auto"` is `static` for a batch; `graphs` runs one prompt.
    """
    prompts = list(prompts) if not isinstance(prompts, (str, torch.Tensor)) else [prompts]
    if not prompts:
        raise ValueError("generate_batch got no prompts: give a list of at least one prompt")
    batched = len(prompts) > 1
    if batched and drafter is not None and not getattr(drafter, "batchable", False):
        raise ValueError(f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r} cannot draft a batch "
                         f"({len(prompts)} prompts): run its prompts one at a time with generate()")
    limits = _row_limits(max_new_tokens, len(prompts))
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    rows = [target.encode_prompt(p, chat=chat) for p in prompts]
    policy, kind, needed, buckets = _plan(target, drafter, shape, rows, limits, cache, cache_capacity, buckets)
    hear = drafter.commit if drafter is not None else _no_commit
    eos = set() if not stop_on_eos else set(target.eos_token_ids if eos is None else eos)
    generators = [torch.Generator(device=target.device).manual_seed(seed + b) for b in range(len(rows))]
    sync = torch.cuda.synchronize if target.device.type == "cuda" else _no_sync
    stats = [GenerationStats() for _ in rows]
    batch_stats = BatchStats(rows=len(rows))
    start = time.perf_counter()

    # Prefill every prompt token but the last, which becomes the root of the first step.
    cache, forward = CACHES[kind](target, cache_capacity or needed, buckets)
    if drafter is not None:
        drafter.reset()
    first = prefill_rows(target, cache, rows) if batched else prefill(target, cache, rows[0])
    hear(first)
    committed = [list(r) for r in rows]
    token_ids, lengths = first.token_ids, first.lengths  # [B, L] committed tokens, rebuilt once per step
    active = list(range(len(rows)))  # the prompt index of each batch row
    outputs: list[GenerationOutput | None] = [None] * len(rows)
    batch_stats.prefill_time_s = time.perf_counter() - start
    for s in stats:
        s.prefill_time_s = batch_stats.prefill_time_s

    while active:
        remaining = [limits[i] - (len(committed[i]) - len(rows[i])) for i in active]
        # 1. Draft (the policy's shape; none, or nodes deeper than remaining - 1, are useless).
        t0 = time.perf_counter()
        context = max(len(committed[i]) for i in active)
        step_shape = policy.choose(context) if max(remaining) > 1 else None
        tc = time.perf_counter()
        drafts = [Draft.empty()] * len(active)
        if step_shape is not None:
            request = DraftRequest(token_ids=token_ids, shape=step_shape, sampling=sampling,
                                   generator=generators[active[0]], max_depth=max(remaining) - 1, lengths=lengths,
                                   generators=[generators[i] for i in active] if batched else None,
                                   max_depths=[r - 1 for r in remaining] if batched else None)
            drafts = drafter.propose_batch(request) if batched else [drafter.propose(request)]
            if len(drafts) != len(active):
                raise ValueError(f"drafter {drafter.name!r} returned {len(drafts)} drafts for {len(active)} rows")
        drafts = [d if d.depth <= r - 1 else d.subtree(tree_ops.prune_to_depth(d.parents, r - 1))
                  for d, r in zip(drafts, remaining)]
        sync()
        proposed, tp = [d.num_nodes for d in drafts], time.perf_counter()
        if not batched:  # auto: the part worth verifying (a batch verifies whole drafts: `observe` below)
            drafts = [policy.trim(drafts[0], len(committed[active[0]]))]

        # 2. Verify: one tree forward of [root, draft nodes] per row (root = block index 0).
        t1 = time.perf_counter()
        begin = cache.length
        past = cache.next_positions if batched else cache.next_position  # each row's block position
        tokens, parents, valid = verify_block(drafts, [committed[i][-1] for i in active])
        out = forward(tokens, cache, parents) if valid is None else forward(tokens, cache, parents, valid=valid)
        sync()
        t2 = time.perf_counter()

        # 3. Accept, per row on its own logits and its own random stream.
        acceptances = [accept(d, out.logits[b:b + 1, : d.num_nodes + 1], sampling, generators[i])
                       for b, (d, i) in enumerate(zip(drafts, active))]

        # 4. Commit: keep each row's root and accepted path in the cache, append the new tokens, and
        #    tell the drafter (its rollback and whatever target state it reads).
        kept = [[0] + [j + 1 for j in a.path] for a in acceptances]
        if batched:
            cache.keep_rows(begin, kept)
        else:
            cache.keep(past, kept[0])
        news = []
        for d, a, i in zip(drafts, acceptances, active):
            draft_tokens = d.tokens[0].tolist()
            news.append([draft_tokens[j] for j in a.path] + [a.next_token])
            committed[i].extend(news[-1])
        token_ids, lengths = left_padded([committed[i] for i in active])
        t3 = time.perf_counter()
        hear(commit_step(drafts, acceptances, kept, news, out, token_ids, lengths, cache, past, batched))
        sync()
        t4 = time.perf_counter()
        for b, (d, a, i) in enumerate(zip(drafts, acceptances, active)):
            record = StepRecord(
                drafted=d.num_nodes, draft_depth=d.depth, accepted=a.num_accepted, bonus=a.bonus,
                draft_time_s=(tp - tc) + (t4 - t3), target_time_s=t2 - t1, other_time_s=0.0,
                shape="" if step_shape is None else str(step_shape), proposed=proposed[b], commit_time_s=t4 - t3,
            )
            record.other_time_s = time.perf_counter() - t0 - record.draft_time_s - record.target_time_s
            t5 = time.perf_counter()
            if batched:
                policy.trim(d, len(committed[i]))  # hands the policy this row's draft (kept whole)
            policy.observe(d, a, record, len(committed[i]))
            record.other_time_s += time.perf_counter() - t5
            stats[i].steps.append(record)
        batch_stats.add_step(t2 - t1, (tp - tc) + (t4 - t3), time.perf_counter() - t0, *tokens.shape)

        # Rows that are done (EOS, or their max_new_tokens) leave the batch.
        done = [b for b, i in enumerate(active)
                if (eos and eos.intersection(news[b])) or len(committed[i]) - len(rows[i]) >= limits[i]]
        for b in done:
            i = active[b]
            new_ids = cut_at_eos(committed[i][len(rows[i]):][: limits[i]], eos)
            stats[i].steps[-1].accepted -= len(committed[i]) - len(rows[i]) - len(new_ids)  # past EOS: never output
            stats[i].new_tokens = len(new_ids)
            stats[i].wall_time_s = time.perf_counter() - start
            outputs[i] = GenerationOutput(token_ids=new_ids, text=target.decode(new_ids), prompt_ids=rows[i],
                                          stats=stats[i])
        if done and len(done) < len(active):
            keep = [b for b in range(len(active)) if b not in done]
            cache.select_rows(keep)
            drafter is not None and drafter.select_rows(keep)
            active = [active[b] for b in keep]
            token_ids, lengths = left_padded([committed[i] for i in active])
        elif done:
            active = []

    result = BatchOutput(outputs)
    batch_stats.wall_time_s = time.perf_counter() - start
    batch_stats.new_tokens = sum(o.stats.new_tokens for o in result)
    batch_stats.row_mal = [o.stats.mean_acceptance_length for o in result]
    result.stats = batch_stats
    return result


def _row_limits(max_new_tokens: int | Sequence[int], rows: int) -> list[int]:
    """`max_new_tokens` per row; ValueError for a list of the wrong length or a value below 1."""
    limits = [max_new_tokens] * rows if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != rows:
        raise ValueError(f"max_new_tokens has {len(limits)} values for {rows} prompts: give one, or one per prompt")
    for value in limits:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {value!r}")
    return limits


def _plan(target: Target, drafter: Drafter | None, shape: str | ShapeSpec | ShapePolicy, rows: list[list[int]],
          limits: list[int], cache: str, cache_capacity: int | None, buckets: Sequence[int] | None,
          ) -> tuple[ShapePolicy, str, int, tuple[int, ...] | None]:
    """Check the inputs before any work and size the cache: (the shape policy, the cache kind, the
    capacity the generation needs, the width buckets). ValueError for a bad shape, a prompt +
    generation past the context, a too short `cache_capacity`, a batch the cache or policy cannot
    run, or a batch whose cache would not fit in memory."""
    spec = None if isinstance(shape, ShapePolicy) else parse_shape(shape)
    kind = resolve_cache(cache, target, len(rows))
    max_nodes = 0 if drafter is None else shape.max_nodes if spec is None else spec.max_nodes
    width, buckets = verification_width(kind, max_nodes + 1, buckets)
    for b, (row, limit) in enumerate(zip(rows, limits)):
        if len(row) + limit > target.context_length:
            which = f"prompt {b} " if len(rows) > 1 else "prompt "
            raise ValueError(
                f"{which}({len(row)} tokens) + max_new_tokens ({limit}) = {len(row) + limit} exceeds the context "
                f"length of {target.label!r} ({target.context_length}); shorten the prompt or lower max_new_tokens"
            )
    longest, most = max(len(r) for r in rows), max(limits)
    if len(rows) == 1:
        needed = longest + most + width - 1
    else:  # rows that accept less than the longest get holes: at most the widest kept path per step
        needed = longest + most * (1 + (0 if drafter is None else _depth_bound(spec, max_nodes))) + width - 1
        if kind == "graphs":
            raise ValueError(f"cache='graphs' runs one prompt at a time; a batch of {len(rows)} runs with cache='static' or 'dynamic'")
        check_memory(target, len(rows), needed)
    if cache_capacity is not None and cache_capacity < needed:
        padded = f", padded to bucket {width}" if kind == "graphs" else ""
        raise ValueError(f"cache_capacity={cache_capacity} is too short: prompt ({longest}) + "
                         f"max_new_tokens ({most}) + draft nodes ({width - 1}{padded}) = {needed}")
    policy = FixedShape(None) if drafter is None else shape if spec is None else shape_policy(
        spec, target, drafter, cache=kind, batch=len(rows))
    return policy, kind, needed, buckets


def _depth_bound(spec: ShapeSpec | None, max_nodes: int) -> int:
    """The deepest draft a shape can make (its node count when not known)."""
    for depth in (getattr(spec, "k", None), len(getattr(spec, "widths", ())) or None, getattr(spec, "depth", None)):
        if isinstance(depth, int):
            return depth
    return max_nodes


def cut_at_eos(new_ids: list[int], eos: set[int]) -> list[int]:
    """The generated tokens up to and including the first EOS (all of them if none)."""
    stop = next((i for i, t in enumerate(new_ids) if t in eos), None)
    return new_ids if stop is None else new_ids[: stop + 1]


def _no_commit(step: Step) -> None:
    """Plain decoding (no drafter): nobody to tell."""
