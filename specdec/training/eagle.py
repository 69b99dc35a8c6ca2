"""Self-distillation for the EAGLE head: batched target rollouts, the multi-depth loss, validation.

Owns `rollout_batch` (the target's own greedy or sampled continuations of many prompts per forward,
left-padded with an attention mask, KV-cached, recording its final hidden states: the data),
`self_instruct` (prompts the target writes itself), `TrainBatch`/`make_batch` (right-padded training
batches), `unroll` (EAGLE-3's training-time test: the head's own predictions fed back for depths
2..k), `depth_losses` (EAGLE's feature regression + cross-entropy against the target's distribution,
per depth, optionally truncated after the first depth the head gets wrong, as Spec-AUF does) and
`acceptance_per_depth` (validation), and `fill_aux` (EAGLE-3's low/mid-layer features of recorded
shards, by a prefill of each sequence; new shards get them from the rollout itself). Knows nothing
about Hydra, files or drafting: prompt sources live in specdec/training/prompts/, shards in
specdec/training/shards.py and scripts/train_eagle.py drives it all.

Alignment (pair j = (feature h_j, token t_{j+1}), as in specdec/drafters/eagle.py). Depth 1 runs the
pairs on the target's true features and predicts h_{j+1}. Depth s >= 2 runs, for every j, the pair
(predicted feature of depth s-1, token t_{j+s}) at position j+s-1, attending to the depth-1 entries
0..j (the committed context at drafting time) and to its own chain's entries of depths 2..s-1, and
predicts h_{j+s}. With s = 3 and j = 4: position 6 reads (out_2[4], t_7), attends depth-1 keys 0..4,
the depth-2 key of j = 4 and itself, and is scored against h_7 (whose lm_head argmax is t_8). That is
exactly what a chain draft from root t_5 computes at its third node, so validation acceptance per depth
below equals chain drafting's greedy acceptance on the same sequences.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaModel

from specdec.runtime.cache import KVCache
from specdec.training.shards import AuxStore, Rollouts, ShardError, ShardStore
from specdec.training.prompts import Prompt, prompt_text
from specdec.training.prompts.templates_v1 import training_prompts  # noqa: F401  (kept import path)
from specdec.runtime.static_cache import StaticKVCache


def _encode(target, prompt: Prompt | str | list[int]) -> list[int]:
    """Token ids of a chat (a one-turn chat encodes like its text), a string or a list of token ids."""
    if isinstance(prompt, tuple) and prompt and isinstance(prompt[0], dict):
        return target.encode_prompt(prompt[0]["content"] if len(prompt) == 1 else list(prompt))
    return target.encode_prompt(prompt)


def aux_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The hidden states of `layers` (HF `hidden_states` indices) side by side, [..., kH] bf16 on the CPU:
    what an AuxStore records, whether from a rollout's forwards or a prefill."""
    return torch.cat([hidden_states[k] for k in layers], -1).to(torch.bfloat16).cpu()


CACHE_KW = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
"""The name transformers' models take their KV cache by (`cache` from 5.24, `past_key_values` before)."""


@torch.inference_mode()
def rollout_batch(target, prompts: list[Prompt | str | list[int]], *, max_new_tokens: int, temperature: float,
                  generator: torch.Generator | None = None, aux_layers: tuple[int, ...] = ()) -> Rollouts:
    """Let `target` continue every prompt at once (temperature 0 = greedy): each prompt prefilled
    alone, then one left-padded batch with an attention mask over the padding and a preallocated KV
    cache. A sequence ends at EOS (dropped) or after `max_new_tokens`; the token whose hidden state was
    never computed (the last) is dropped. A row that ends leaves the batch (its cache rows are
    dropped), so long answers do not make short ones pay for padding steps.
    Hidden states come back on the CPU as float32; `prompt_index` is left to the caller (empty).
    With `aux_layers`, `aux` holds the hidden states of those layers at every kept position (bf16, the
    same states fill_aux's prefill computes, up to rounding), taken from the rollout's own forwards.

    Why prefill one prompt at a time: a padded [64, 222]-token prefill spends more time in its
    elementwise ops over [64, 222, 1536] activations than in its matrix products on a CPU, and pads
    every prompt to the longest; why a preallocated cache: a growing one copies every layer's keys
    and values at every step."""
    device = target.device
    eos = torch.tensor(sorted(target.eos_token_ids) or [-1], dtype=torch.long, device=device)
    encoded = [_encode(target, p) for p in prompts]
    b, width = len(encoded), max(map(len, encoded))
    want_aux = bool(aux_layers)
    # Worked example: lengths 3 and 5, width 5 -> mask rows [0 0 1 1 1] and [1 1 1 1 1], positions
    # [0 0 0 1 2] and [0 1 2 3 4]: every real token gets the position it has unpadded.
    mask = (torch.arange(width, device=device)[None]
            >= torch.tensor([width - len(e) for e in encoded], device=device)[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, width]
    prompt_h, prompt_aux = [], []  # per row [len, H], [len, kH]
    keys, values = [], []  # per layer [b, kv_heads, width + max_new_tokens, D], rows left-padded with zeros
    for row, e in enumerate(encoded):
        alone = KVCache()
        out = target.base(input_ids=torch.tensor([e], device=device), **{CACHE_KW: alone.hf}, use_cache=True,
                          output_hidden_states=want_aux)
        prompt_h.append(out.last_hidden_state[0])
        if want_aux:
            prompt_aux.append(aux_features(out.hidden_states, aux_layers)[0])
        for layer, (k, v) in enumerate(alone.tensors()):
            if row == 0:  # zeros in the padding: masked, but 0 x NaN garbage would still be NaN
                shape = (b, k.shape[1], width + max_new_tokens, k.shape[-1])
                keys.append(k.new_zeros(shape))
                values.append(v.new_zeros(shape))
            keys[layer][row, ..., width - len(e):width, :] = k[0]
            values[layer][row, ..., width - len(e):width, :] = v[0]
    cache = StaticKVCache.over(keys, values, width)
    del keys, values
    live = torch.arange(b)  # original row of each batch entry still generating
    last_h, last = torch.stack([x[-1] for x in prompt_h]), positions[:, -1]  # [live, H], [live]
    tokens = [[] for _ in range(b)]  # generated ids per row (EOS included)
    hidden = [[] for _ in range(b)]  # [H] per generated token fed back (all but EOS and the very last)
    aux = [[] for _ in range(b)]  # [kH] per such token, with aux_layers
    for step in range(max_new_tokens):
        logits = target.lm_head(last_h).float()  # [live, V]
        if target.softcap:
            logits = torch.tanh(logits / target.softcap) * target.softcap
        if temperature > 0:
            probs = (logits / temperature).softmax(-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(device)
        else:
            nxt = logits.argmax(-1)
        for row, tok in zip(live.tolist(), nxt.tolist()):
            tokens[row].append(tok)
        going = ~torch.isin(nxt, eos)  # [live]
        if step == max_new_tokens - 1 or not bool(going.any()):
            break
        if not bool(going.all()):  # finished rows leave the batch: later forwards cost only the live rows
            keep = going.nonzero()[:, 0]
            cache.select_rows(keep)
            live, nxt, mask, last = live[keep.cpu()], nxt[keep], mask[keep], last[keep]
        mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long, device=device)], 1)
        last = last + 1
        out = target.base(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                          **{CACHE_KW: cache.hf}, use_cache=True, output_hidden_states=want_aux)
        last_h = out.last_hidden_state[:, -1]  # [live, H]
        for row, vec in zip(live.tolist(), last_h.float().cpu()):
            hidden[row].append(vec)
        if want_aux:
            for row, vec in zip(live.tolist(), aux_features(out.hidden_states, aux_layers)[:, -1]):
                aux[row].append(vec)
    result = Rollouts([], [])
    for row, e in enumerate(encoded):
        keep = len(hidden[row])  # generated tokens whose hidden state exists (EOS and the last one have none)
        gen_h = torch.stack(hidden[row]) if keep else prompt_h[row][:0].float().cpu()
        result.sequences.append(torch.tensor(e + tokens[row][:keep]))
        result.hidden.append(torch.cat([prompt_h[row].float().cpu(), gen_h]))
        result.prompt_len.append(len(e))
        result.temperature.append(float(temperature))
        if want_aux:
            gen_a = torch.stack(aux[row]) if keep else prompt_aux[row][:0]
            result.aux.append(torch.cat([prompt_aux[row], gen_a]))
    return result


def fill_shards(target, store: ShardStore, prompts: list[Prompt | str | list[int]], *, shard_prompts: int,
                batch_size: int, max_new_tokens: int, sampled_fraction: float = 0.0, temperature: float = 0.7,
                seed: int = 0, hidden_dtype: torch.dtype = torch.bfloat16, deadline: float = float("inf"),
                max_shards: int | None = None, worker: tuple[int, int] = (0, 1), skip: set[int] = frozenset(),
                aux_store: AuxStore | None = None, desc: str = "rollouts") -> None:
    """Write every shard of `prompts` that `store` lacks, in index order, until time.perf_counter()
    passes `deadline` or `max_shards` were written. Shard i holds prompts [i * shard_prompts,
    (i + 1) * shard_prompts); it is sampled (at `temperature`) when sampled_fraction > 0 and
    i % round(1 / sampled_fraction) is the last residue, else greedy; its sampling seed depends on
    (seed, i) only, so a shard's content does not depend on which run wrote it. `worker=(k, n)` writes
    only shards i with i % n == k (n processes share the prompt list, each with its own store);
    `skip` lists shards another store already holds. With `aux_store` (over `store`), each new shard's
    aux features are recorded from the rollout's own forwards right after the shard (fill_aux then
    has nothing left to do for it; a shard whose aux write was interrupted is left to fill_aux)."""
    import time

    from tqdm import tqdm

    every = round(1 / sampled_fraction) if sampled_fraction > 0 else 0
    num_shards = -(-len(prompts) // shard_prompts)
    texts = [prompt_text(p) if isinstance(p, tuple) else str(p) for p in prompts]
    for i in store.done():
        if i >= num_shards:
            raise ShardError(f"{store.root} records shard {i} but the prompt list has only {num_shards} shards")
        store.check_prompts(i, texts[i * shard_prompts:(i + 1) * shard_prompts])
    k, n = worker
    if not 0 <= k < n:
        raise ValueError(f"worker must be (k, n) with 0 <= k < n, got {worker}")
    todo = [i for i in range(num_shards) if i % n == k and i not in store.done() and i not in skip][:max_shards]
    bar = tqdm(todo, desc=desc, unit="shard")
    tokens, started = 0, time.perf_counter()
    for i in bar:
        if time.perf_counter() > deadline:
            print(f"{desc}: deadline reached with {len(store.done())}/{num_shards} shards recorded; rerun to continue",
                  flush=True)
            break
        rows = range(i * shard_prompts, min(len(prompts), (i + 1) * shard_prompts))
        shard_temperature = temperature if every and i % every == every - 1 else 0.0
        generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
        parts = []
        for start in range(rows.start, rows.stop, batch_size):
            batch_rows = list(range(start, min(rows.stop, start + batch_size)))
            part = rollout_batch(target, [prompts[r] for r in batch_rows], max_new_tokens=max_new_tokens,
                                 temperature=shard_temperature, generator=generator,
                                 aux_layers=aux_store.layers if aux_store is not None else ())
            part.prompt_index = batch_rows
            parts.append(part)
            tokens += sum(s.numel() - n for s, n in zip(part.sequences, part.prompt_len))
            bar.set_postfix(gen_tok_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
        shard = Rollouts.concat(parts)
        store.write(i, shard, [texts[r] for r in rows], hidden_dtype)
        if aux_store is not None:
            aux_store.write(i, torch.cat(shard.aux))


@torch.inference_mode()
def fill_aux(target, aux_store: AuxStore, *, worker: tuple[int, int] = (0, 1), desc: str = "aux features") -> int:
    """Compute and record, for every shard of `aux_store.store` that lacks them, the target's hidden
    states at `aux_store.layers` for every token (one causal prefill per sequence: the same states the
    rollout's KV-cached steps computed, up to rounding). `worker=(k, n)`: only shards i % n == k.
    Returns how many shards it filled."""
    from tqdm import tqdm

    k, n = worker
    store = aux_store.store
    todo = [i for i in sorted(store.done()) if i % n == k and i not in aux_store.done()]
    for i in tqdm(todo, desc=desc, unit="shard"):
        rollouts = store.read(i)
        rows = []
        for seq in rollouts.sequences:
            states = target.base(input_ids=seq[None].to(target.device), output_hidden_states=True).hidden_states
            rows.append(aux_features(states, aux_store.layers)[0])
        aux_store.write(i, torch.cat(rows))
    return len(todo)


def self_instruct(target, topics: list[str], n: int, *, seed: int = 0, batch_size: int = 16,
                  max_new_tokens: int = 40) -> list[Prompt]:
    """Up to `n` distinct questions the target writes when asked to pose one on each seed topic
    (sampled at temperature 0.9; the first line ending in '?' is kept)."""
    import random

    rng = random.Random(f"self-instruct-{seed}")
    asks = ["Write one question a curious person might ask an AI assistant about {t}. Reply with the question only.",
            "Suggest a question about {t} that someone could ask a chatbot. Only write the question.",
            "Write a request a user might send to an assistant that involves {t}. Reply with the request only."]
    generator = torch.Generator().manual_seed(seed)
    out, seen = [], set()
    for _ in range(max(1, 3 * n // batch_size + 1)):
        if len(out) >= n:
            break
        asked = [rng.choice(asks).format(t=rng.choice(topics)) for _ in range(batch_size)]
        batch = rollout_batch(target, asked, max_new_tokens=max_new_tokens, temperature=0.9, generator=generator)
        for seq, plen in zip(batch.sequences, batch.prompt_len):
            text = target.decode(seq[plen:].tolist()).strip()
            line = next((ln.strip().strip('"') for ln in text.splitlines() if ln.strip().endswith("?")), "")
            if 4 <= len(line.split()) <= 40 and line not in seen and len(out) < n:
                seen.add(line)
                out.append(({"role": "user", "content": line},))
    return out


@dataclass
class TrainBatch:
    """Right-padded training rows: pair j of row b = (hidden[b, j], tokens[b, j + 1])."""

    tokens: torch.Tensor  # [B, L] long (0 on padding)
    hidden: torch.Tensor  # [B, L, H] float32 target features
    length: torch.Tensor  # [B] real tokens per row
    generated: torch.Tensor  # [B, L] bool: the token is the target's continuation (not prompt, not padding)
    aux: torch.Tensor | None = None  # [B, L, kH] float32 aux-layer features (None: the data has none)


def make_batch(data: Rollouts, rows: list[int], max_len: int, device: torch.device | str = "cpu") -> TrainBatch:
    """Rows of `data` (each cropped to its first `max_len` tokens) as one right-padded batch."""
    lengths = [min(data.sequences[r].numel(), max_len) for r in rows]
    width, hsize = max(lengths), data.hidden[rows[0]].shape[-1]
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    hidden = torch.zeros(len(rows), width, hsize)
    generated = torch.zeros(len(rows), width, dtype=torch.bool)
    aux = torch.zeros(len(rows), width, data.aux[rows[0]].shape[-1]) if data.aux else None
    for b, (r, n) in enumerate(zip(rows, lengths)):
        tokens[b, :n], hidden[b, :n] = data.sequences[r][:n], data.hidden[r][:n].float()
        generated[b, data.prompt_len[r]:n] = True
        if aux is not None:
            aux[b, :n] = data.aux[r][:n].float()
    return TrainBatch(tokens.to(device), hidden.to(device), torch.tensor(lengths, device=device), generated.to(device),
                      None if aux is None else aux.to(device))


def ttt_mask(n: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [n, step * n] for depth `step` (1-based) over the cached depths 1..step: query j
    sees depth-1 keys 0..j and, at each deeper depth, only its own chain's key j.
    Example n = 3, step = 2 (1 = visible): [[1 0 0 | 1 0 0], [1 1 0 | 0 1 0], [1 1 1 | 0 0 1]]."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    visible = torch.cat([torch.ones(n, n, dtype=torch.bool, device=device).tril()] + [eye] * (step - 1), 1)
    return torch.zeros(n, step * n, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)


def unroll(head, embed, batch: TrainBatch, depth: int, noise: float = 0.0,
           generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The head's predicted features for depths 1..depth, each [B, n, H] with n = L - 1 pairs; entry
    j of depth s predicts h_{j+s} (see the module docstring). Depth 1 reads the true features (with
    the batch's aux layers, if any, as drafting does; plus uniform noise of width `noise`, EAGLE's
    robustness trick); deeper depths read the previous depth's predictions (gradients flow through them)."""
    n = batch.tokens.shape[1] - 1
    feats = batch.hidden[:, :n]  # [B, n, H]
    if batch.aux is not None:
        feats = torch.cat([feats, batch.aux[:, :n]], -1)  # [B, n, (1 + k) H]
    if noise > 0:
        feats = feats + (torch.rand(feats.shape, generator=generator).to(feats.device) - 0.5) * noise
    dtype = head.fc.weight.dtype
    cache = DynamicCache()
    outs = []
    for s in range(1, depth + 1):
        tokens = F.pad(batch.tokens[:, s:], (0, s - 1))  # [B, n]: t_{j+s}, 0 past the end
        embeds = embed(tokens).to(dtype)
        positions = torch.arange(n, device=tokens.device) + (s - 1)
        mask = ttt_mask(n, s, dtype, tokens.device)
        feats = head(feats.to(dtype), embeds, positions, mask, cache)
        outs.append(feats)
    return outs


def depth_targets(batch: TrainBatch, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth s: (h_{j+s} [B, n, H], valid [B, n] bool: j + s < length)."""
    n = batch.tokens.shape[1] - 1
    j = torch.arange(n, device=batch.tokens.device)
    out = []
    for s in range(1, depth + 1):
        target = F.pad(batch.hidden[:, s:], (0, 0, 0, s - 1))  # [B, n, H]
        out.append((target, (j[None] + s) < batch.length[:, None]))
    return out


def depth_losses(predicted: list[torch.Tensor], batch: TrainBatch, vocab_weight: torch.Tensor, *,
                 ce_weight: float, depth_decay: float = 1.0, truncate: bool = False, generated_only: bool = False
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss per depth, summed over depths with weight depth_decay**(s-1): SmoothL1(predicted,
    true feature) + ce_weight * CE(target's probs, head's probs), both over the rows of
    `vocab_weight` [N, H] (the draft vocabulary). Each depth's sum over positions is divided by the
    number of depth-1 positions, so depths are weighted by how often they are reached. truncate: a
    position counts at depth s only if the head's top token was right at depths 1..s-1 (Spec-AUF).
    generated_only: pair j counts at depth s only if the token its prediction is scored against,
    t_{j+s+1} (the lm_head argmax of h_{j+s}), is the target's continuation, as validation and
    drafting count (prompt tokens are never drafted)."""
    targets = depth_targets(batch, len(predicted))
    if generated_only:  # e.g. prompt_len 3: depth 1 keeps pairs j >= 1 (t_{j+2} at index >= 3)
        targets = [(true, valid & F.pad(batch.generated[:, s + 1:], (0, s)))
                   for s, (true, valid) in enumerate(targets, start=1)]
    count = targets[0][1].sum().clamp(min=1)
    reached = targets[0][1]  # [B, n]
    total = predicted[0].new_zeros(())
    stats: dict[str, float] = {}
    for s, (pred, (true, valid)) in enumerate(zip(predicted, targets), start=1):
        use = valid & reached if truncate else valid
        p, h = pred[use].float(), true[use]  # [M, H]
        regression = F.smooth_l1_loss(p, h, reduction="none").mean(-1)  # [M]
        with torch.no_grad():
            teacher_logits = F.linear(h, vocab_weight)  # [M, N]
        log_student = F.linear(p, vocab_weight).log_softmax(-1)
        ce = -(teacher_logits.softmax(-1) * log_student).sum(-1)  # [M]
        total = total + depth_decay ** (s - 1) * (regression + ce_weight * ce).sum() / count
        with torch.no_grad():
            right = torch.zeros_like(valid)
            right[use] = log_student.argmax(-1) == teacher_logits.argmax(-1)
            reached = reached & right
            stats[f"top1@{s}"] = float(right[valid].float().mean()) if valid.any() else 0.0
    return total, stats


@torch.no_grad()
def acceptance_per_depth(head, embed, vocab_weight: torch.Tensor, vocab: torch.Tensor, batches: list[TrainBatch],
                         depth: int) -> dict[str, float]:
    """Greedy chain acceptance of specdec's own head (`chain_acceptance`), its draft token of depth s the
    argmax over `vocab` [N] of its prediction scored by the lm_head rows `vocab_weight` [N, H]."""
    return chain_acceptance(head, embed, batches, depth,
                            lambda pred: vocab[F.linear(pred.float(), vocab_weight).argmax(-1)])


@torch.no_grad()
def chain_acceptance(head, embed, batches: list[TrainBatch], depth: int, draft_tokens) -> dict[str, float]:
    """Greedy chain acceptance on target sequences: for every pair j whose next `depth + 1` tokens are
    the target's greedy continuation, the draft token of depth s (`draft_tokens(prediction)` -> [B, n]
    target ids) is compared with t_{j+s+1}. Returns `acc@s` = P(depth s right | depths 1..s-1 right)
    and `chain_mal` = 1 + sum_s P(depths 1..s right) (mean acceptance length of chain(depth), bonus
    included)."""
    reach = torch.zeros(depth + 1)
    for batch in batches:
        outs = unroll(head, embed, batch, depth)
        n = batch.tokens.shape[1] - 1
        j = torch.arange(n, device=batch.tokens.device)
        # counted pairs: t_{j+2} .. t_{j+depth+1} all exist and are the target's (greedy) continuation
        alive = F.pad(batch.generated[:, 2:], (0, 1)) & ((j[None] + depth + 1) < batch.length[:, None])  # [B, n]
        reach[0] += alive.sum().item()
        for s, pred in enumerate(outs, start=1):
            truth = F.pad(batch.tokens[:, s + 1:], (0, s))  # [B, n] t_{j+s+1}
            alive = alive & (draft_tokens(pred) == truth)
            reach[s] += alive.sum().item()
    stats = {f"acc@{s}": float(reach[s] / reach[s - 1]) if reach[s - 1] > 0 else 0.0 for s in range(1, depth + 1)}
    stats["chain_mal"] = float(1 + reach[1:].sum() / reach[0]) if reach[0] > 0 else 1.0
    stats["positions"] = int(reach[0])
    return stats
