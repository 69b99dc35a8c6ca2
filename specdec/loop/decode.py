"""The one speculative decoding loop: draft -> verify -> accept -> commit, one `StepEvent` per step.

Owns `decode` (the loop, a generator), `DecodeConfig`, `generate` / `generate_batch` (folds of the events) and the
target's KV cache for one decode (created and rolled back here only). The cache holds every committed token but the
last, the *root*; each step forwards [root, draft nodes...] in one tree forward, in the shape a `specdec.loop.policy`
policy asks for, and ends in `drafter.commit(Step)`. Knows nothing about how a drafter drafts or how acceptance is
decided; tools see a step only through its event; a batch's padding is `specdec.loop.rows`'.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from specdec.core import tree as tree_ops
from specdec.core.acceptance import accept
from specdec.core.draft import Acceptance, Draft, Drafter, DraftRequest, Step
from specdec.core.events import PhaseTimes, StepEvent
from specdec.core.metrics import BatchStats, GenerationStats, StepRecord
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import ShapeSpec, parse_shape
from specdec.loop.policy import FixedShape, ShapePolicy, shape_policy
from specdec.loop.rows import check_memory, commit_step, left_padded, prefill_rows, verify_block
from specdec.runtime.cache import Cache
from specdec.runtime.forwards import CACHES, resolve_cache, verification_width
from specdec.runtime.model import Target

Prompt = str | Sequence[int] | Sequence[dict]


@dataclass(frozen=True)
class DecodeConfig:
    """Everything a decode takes besides the target, the drafter and the prompts."""

    shape: str | ShapeSpec | ShapePolicy = "chain(4)"
    """A concrete shape (`chain(4)`, `tree(4,2)`, `dynamic(...)`), `auto` (`specdec.loop.policy`), or a
    `ShapePolicy` object."""
    max_new_tokens: int | Sequence[int] = 64  # New tokens per row: one number, or one per prompt; each >= 1.
    temperature: float = 0.0  # 0: greedy (the target's argmax); > 0: sampling from the target's tempered law.
    top_k: int = 0  # Keep the k most likely tokens of the target's law (0: all).
    top_p: float = 1.0  # Keep the smallest set of most likely tokens whose mass reaches p (1: all).
    seed: int = 0  # Row b draws its randomness from a generator seeded `seed + b`.
    chat: bool = True  # Apply the tokenizer's chat template to string prompts.
    stop_on_eos: bool = True  # Stop a row at its first stop token (False: only `max_new_tokens` stops it).
    eos: Collection[int] | None = None  # The stop set (None: the target's EOS tokens).
    force: Sequence[Sequence[int]] | None = None
    """Teacher forcing: per row, the tokens to commit whatever was accepted (the longest draft path that
    matches them keeps its cache entries; the drafter hears that path as accepted). None: off."""
    cache: str = "auto"  # `auto` or a key of `specdec.runtime.forwards.CACHES`.
    cache_capacity: int | None = None  # Slots of a preallocated cache (None: just enough).
    buckets: Sequence[int] | None = None
    """Verification widths of `cache="graphs"` (None: `specdec.runtime.graphs.DEFAULT_BUCKETS`, widened
    to the shape's largest draft when needed)."""
    sampling: SamplingConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling", SamplingConfig(temperature=self.temperature, top_k=self.top_k,
                                                            top_p=self.top_p, seed=self.seed))


@dataclass
class GenerationOutput:
    token_ids: list[int]  # New tokens only (the stop token, when generation stopped on it, included).
    text: str  # Decoded `token_ids` (special tokens skipped).
    prompt_ids: list[int]
    stats: GenerationStats


class BatchOutput(list):
    """`generate_batch`'s result: one `GenerationOutput` per prompt, in order, plus `stats`."""

    stats: BatchStats


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


def decode(target: Target, drafter: Drafter | None, prompts: Sequence[Prompt],
           config: DecodeConfig = DecodeConfig()) -> Iterator[StepEvent]:
    """Decode `prompts` as one batch, one `StepEvent` per step: at T = 0 the target's greedy decoding at the width it
    verifies, at T > 0 its sampling law (after top-k / top-p). Input errors come before any work."""
    rows, limits, policy, kind, needed, buckets = _plan(target, drafter, prompts, config)
    batched, sampling, hear = len(rows) > 1, config.sampling, drafter.commit if drafter is not None else _no_commit
    stop = _stop_set(target, config)
    generators = [torch.Generator(device=target.device).manual_seed(config.seed + b) for b in range(len(rows))]
    sync = torch.cuda.synchronize if target.device.type == "cuda" else _no_sync
    start = time.perf_counter()

    # Prefill every prompt token but the last, which becomes the root of the first step.
    cache, forward = CACHES[kind](target, config.cache_capacity or needed, buckets)
    drafter is not None and drafter.reset()
    first = prefill_rows(target, cache, rows) if batched else prefill(target, cache, rows[0])
    hear(first)
    committed, token_ids, lengths = [list(r) for r in rows], first.token_ids, first.lengths
    active, index, observed = list(range(len(rows))), 0, 0.0  # active: the prompt index of each batch row
    while active:
        t0, contexts = time.perf_counter(), [len(committed[i]) for i in active]  # tokens before this step
        remaining = [limits[i] - (c - len(rows[i])) for c, i in zip(contexts, active)]
        # 1. Draft: the policy's shape (none, or nodes deeper than remaining - 1, are useless), then the
        #    part of each proposal the policy keeps.
        shape = policy.choose(max(contexts)) if max(remaining) > 1 else None
        t1 = time.perf_counter()
        proposals = [Draft.empty()] * len(active) if shape is None else _propose(
            drafter, DraftRequest(token_ids=token_ids, shape=shape, sampling=sampling, generator=generators[active[0]],
                                  max_depth=max(remaining) - 1, lengths=lengths,
                                  generators=[generators[i] for i in active] if batched else None,
                                  max_depths=[r - 1 for r in remaining] if batched else None))
        sync()
        t2 = time.perf_counter()
        kept = [_kept(policy, d, r, len(committed[i])) for d, r, i in zip(proposals, remaining, active)]
        drafts = [d if k is None else d.subtree(k) for d, k in zip(proposals, kept)]

        # 2. Verify: one tree forward of [root, draft nodes] per row (root = block index 0).
        t3 = time.perf_counter()
        begin, past = cache.length, cache.next_positions if batched else cache.next_position
        tokens, parents, valid = verify_block(drafts, [committed[i][-1] for i in active])
        out = forward(tokens, cache, parents) if valid is None else forward(tokens, cache, parents, valid=valid)
        sync()
        t4 = time.perf_counter()

        # 3. Accept, per row on its own logits and its own random stream (under `force`, the forced tokens).
        acceptances = [accept(d, out.logits[b:b + 1, : d.num_nodes + 1], sampling, generators[i])
                       for b, (d, i) in enumerate(zip(drafts, active))]
        decided = acceptances if config.force is None else [
            _forced(d, config.force[i][len(committed[i]) - len(rows[i]):]) for d, i in zip(drafts, active)]
        paths = [[0] + [j + 1 for j in a.path] for a in decided]
        cache.keep_rows(begin, paths) if batched else cache.keep(past, paths[0])
        news = [[d.tokens[0, j].item() for j in a.path] + [a.next_token] for d, a in zip(drafts, decided)]
        for i, new in zip(active, news):
            committed[i].extend(new)
        token_ids, lengths = left_padded([committed[i] for i in active])
        t5 = time.perf_counter()

        # 4. Commit: the drafter hears the step (its rollback and whatever target state it reads).
        hear(commit_step(drafts, decided, paths, news, out, token_ids, lengths, cache, past, batched))
        sync()
        t6 = time.perf_counter()
        done = [bool(stop.intersection(new)) or len(committed[i]) - len(rows[i]) >= limits[i]
                for new, i in zip(news, active)]
        event = StepEvent(index=index, rows=list(active), shape=shape, proposals=proposals, drafts=drafts, kept=kept,
                          acceptances=acceptances, paths=[a.path for a in decided], committed=news, done=done,
                          logits=out.logits, contexts=contexts, width=tokens.shape[1], times=PhaseTimes(
                              choose=observed + (t1 - t0) + (t3 - t2), propose=t2 - t1, forward=t4 - t3, accept=t5 - t4,
                              commit=t6 - t5), start_s=t0 - start)
        for b in range(len(active)):
            policy.observe(event, b)
        observed = time.perf_counter() - t6  # the policy's time, counted in the next step's `choose`
        yield event
        # Rows that are done (a stop token, or their max_new_tokens) leave the batch.
        index, keep = index + 1, [b for b, finished in enumerate(done) if not finished]
        if keep and len(keep) < len(active):
            cache.select_rows(keep)
            drafter is not None and drafter.select_rows(keep)
            token_ids, lengths = left_padded([committed[active[b]] for b in keep])
        active = [active[b] for b in keep]


def generate(target: Target, drafter: Drafter | None, prompt: Prompt, config: DecodeConfig | None = None,
             **options) -> GenerationOutput:
    """Generate from `target`, drafting with `drafter` (None = plain decoding): `decode` over one prompt (a string,
    chat messages or token ids); `options` are `DecodeConfig` fields (over `config`)."""
    return generate_batch(target, drafter, [prompt], config, **options)[0]


def generate_batch(target: Target, drafter: Drafter | None, prompts: Sequence[Prompt],
                   config: DecodeConfig | None = None, **options) -> BatchOutput:
    """`generate` for a list of prompts at once: one output per prompt, its statistics, and the batch's. A finished row
    leaves the batch; a drafter must be batchable for more than one prompt. Row b draws only from its own generator,
    seeded `seed + b`: with a concrete shape its output equals `generate(..., seed=seed + b)` on its prompt alone, token
    for token; with `shape="auto"` (one shape per step for the batch) token for token at T = 0 and in law at T > 0."""
    config = replace(config, **options) if config is not None else DecodeConfig(**options)
    rows, stop = encode_prompts(target, prompts, config.chat), _stop_set(target, config)
    outputs, stats = [[] for _ in rows], [GenerationStats() for _ in rows]
    batch = BatchStats(rows=len(rows))
    for event in decode(target, drafter, rows, config):
        t = event.times
        if event.index == 0:
            batch.prefill_time_s = event.start_s
        batch.add_step(t.forward, t.propose + t.commit, t.total, len(event.rows), event.width)
        for b, i in enumerate(event.rows):
            kept = cut_at_eos(outputs[i] + event.committed[b], stop)[: _limit(config.max_new_tokens, i)]
            d = event.drafts[b]
            stats[i].steps.append(StepRecord(  # accepted: the tokens this step added to the output, less one
                drafted=d.num_nodes, draft_depth=d.depth, accepted=len(kept) - len(outputs[i]) - 1,
                bonus=event.acceptances[b].bonus, proposed=event.proposals[b].num_nodes,
                draft_time_s=t.propose + t.commit, target_time_s=t.forward, other_time_s=t.choose + t.accept,
                shape="" if event.shape is None else str(event.shape), commit_time_s=t.commit))
            outputs[i] = kept
            if event.done[b]:
                stats[i].new_tokens, stats[i].wall_time_s = len(kept), event.start_s + t.total
    for s in stats:
        s.prefill_time_s = batch.prefill_time_s
    result = BatchOutput(GenerationOutput(token_ids=ids, text=target.decode(ids), prompt_ids=row, stats=s)
                         for ids, row, s in zip(outputs, rows, stats))
    batch.wall_time_s = max(s.wall_time_s for s in stats)
    batch.new_tokens = sum(s.new_tokens for s in stats)
    batch.row_mal = [s.mean_acceptance_length for s in stats]
    result.stats = batch
    return result


def _propose(drafter: Drafter, request: DraftRequest) -> list[Draft]:
    """One proposal per row of the request; ValueError when the drafter returns another count."""
    rows = request.token_ids.shape[0]
    drafts = drafter.propose_batch(request) if request.generators is not None else [drafter.propose(request)]
    if len(drafts) != rows:
        raise ValueError(f"drafter {drafter.name!r} returned {len(drafts)} drafts for {rows} rows")
    return drafts


def _limit(max_new_tokens: int | Sequence[int], row: int) -> int:
    return max_new_tokens if isinstance(max_new_tokens, int) else max_new_tokens[row]


def _kept(policy: ShapePolicy, proposal: Draft, remaining: int, context: int) -> torch.Tensor | None:
    """The proposal's nodes to verify (None = all): those within the row's remaining depth, then the
    part of them the policy keeps (indices into the proposal)."""
    pruned = None if proposal.depth <= remaining - 1 else tree_ops.prune_to_depth(proposal.parents, remaining - 1)
    draft = proposal if pruned is None else proposal.subtree(pruned)
    kept = policy.keep(draft, context)
    return pruned if kept is None else kept if pruned is None else pruned[kept]


def _forced(draft: Draft, force: Sequence[int]) -> Acceptance:
    """Teacher forcing: the longest draft path whose tokens are the next forced tokens, then the forced
    token after it. Example: force [5, 7, 2], a chain drafting [5, 9]: path [0], next token 7."""
    if not force:
        raise ValueError("force ran out: give each row at least max_new_tokens forced tokens")
    path, node, kids = [], -1, tree_ops.children(draft.parents)
    tokens = draft.tokens[0].tolist()
    while len(path) + 1 < len(force):
        node = next((c for c in kids[node] if tokens[c] == force[len(path)]), None)
        if node is None:
            break
        path.append(node)
    return Acceptance(path=path, next_token=int(force[len(path)]), bonus=False)


def _plan(target: Target, drafter: Drafter | None, prompts: Sequence[Prompt], config: DecodeConfig,
          ) -> tuple[list[list[int]], list[int], ShapePolicy, str, int, tuple[int, ...] | None]:
    """Check the inputs before any work and size the cache: (token ids, limits, shape policy, cache kind,
    capacity, width buckets); TypeError / ValueError naming what is wrong."""
    rows = encode_prompts(target, prompts, config.chat)
    limits = [_limit(config.max_new_tokens, b) for b in range(len(rows))] if isinstance(
        config.max_new_tokens, int) or len(config.max_new_tokens) == len(rows) else None
    if limits is None:
        raise ValueError(f"max_new_tokens has {len(config.max_new_tokens)} values for {len(rows)} prompts: give one, "
                         "or one per prompt")
    for value in limits:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {value!r}")
    if config.force is not None and len(config.force) != len(rows):
        raise ValueError(f"force has {len(config.force)} rows for {len(rows)} prompts: give one token list per prompt")
    if len(rows) > 1 and drafter is not None and not getattr(drafter, "batchable", False):
        raise ValueError(f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r} cannot draft a batch "
                         f"({len(rows)} prompts): run its prompts one at a time with generate()")
    shape = config.shape
    spec = None if isinstance(shape, ShapePolicy) else parse_shape(shape)
    kind = resolve_cache(config.cache, target, len(rows))
    max_nodes = 0 if drafter is None else shape.max_nodes if spec is None else spec.max_nodes
    width, buckets = verification_width(kind, max_nodes + 1, config.buckets)
    for b, (row, limit) in enumerate(zip(rows, limits)):
        if len(row) + limit > target.context_length:
            which = f"prompt {b} " if len(rows) > 1 else "prompt "
            raise ValueError(
                f"{which}({len(row)} tokens) + max_new_tokens ({limit}) = {len(row) + limit} exceeds the context "
                f"length of {target.label!r} ({target.context_length}); shorten the prompt or lower max_new_tokens")
    longest, most = max(len(r) for r in rows), max(limits)
    if len(rows) == 1:
        needed = longest + most + width - 1
    else:  # rows that accept less than the longest get holes: at most the widest kept path per step
        depth = 0 if drafter is None else getattr(spec, "depth", max_nodes)
        needed = longest + most * (1 + depth) + width - 1
        if kind == "graphs":
            raise ValueError(f"cache='graphs' runs one prompt at a time; a batch of {len(rows)} runs with "
                             "cache='static' or 'dynamic'")
        check_memory(target, len(rows), needed)
    if config.cache_capacity is not None and config.cache_capacity < needed:
        padded = f", padded to bucket {width}" if kind == "graphs" else ""
        raise ValueError(f"cache_capacity={config.cache_capacity} is too short: prompt ({longest}) + "
                         f"max_new_tokens ({most}) + draft nodes ({width - 1}{padded}) = {needed}")
    policy = FixedShape(None) if drafter is None else shape if spec is None else shape_policy(
        spec, target, drafter, cache=kind, batch=len(rows))
    return rows, limits, policy, kind, needed, buckets


def encode_prompts(target: Target, prompts: Sequence[Prompt], chat: bool) -> list[list[int]]:
    """Each prompt's token ids (`Target.encode_prompt`); TypeError for prompts that are not a list, and
    TypeError / ValueError naming the row of a bad prompt."""
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}: wrap one prompt as "
                        "[prompt], or call specdec.generate")
    if not prompts:
        raise ValueError("got no prompts: give a list of at least one prompt")
    rows = []
    for b, prompt in enumerate(prompts):
        try:
            rows.append(target.encode_prompt(prompt, chat=chat))
        except (TypeError, ValueError) as err:
            raise type(err)(f"prompt {b}: {err}") from None
    return rows


def _stop_set(target: Target, config: DecodeConfig) -> set[int]:
    return set() if not config.stop_on_eos else set(target.eos_token_ids if config.eos is None else config.eos)


def cut_at_eos(new_ids: list[int], eos: set[int]) -> list[int]:
    """The generated tokens up to and including the first stop token (all of them if none)."""
    stop = next((i for i, t in enumerate(new_ids) if t in eos), None)
    return new_ids if stop is None else new_ids[: stop + 1]


def _no_sync() -> None:
    """Host and device are one (CPU): nothing to wait for."""


def _no_commit(step: Step) -> None:
    """Plain decoding (no drafter): nobody to tell."""
