"""Self-distillation for the EAGLE head: batched target rollouts, training batches, the multi-depth loss, validation.

Owns `Rollouts`, `rollout_batch`, `TrainBatch`/`make_batch`, `unroll` (EAGLE-3's training-time test: depth s runs
(depth s-1's prediction, t_{j+s}) as a chain draft would, so validation acceptance equals chain drafting's),
`depth_losses` and `acceptance_per_depth`. Knows nothing about files or drafting.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaModel

from specdec.runtime.cache import KVCache
from specdec.runtime.static_cache import StaticKVCache
from specdec.training.prompts import Prompt


@dataclass
class Rollouts:
    """The target's own sequences and final hidden states (the head's training data)."""

    sequences: list[torch.Tensor]  # Each [L] long: chat-formatted prompt + the target's continuation.
    hidden: list[torch.Tensor]  # Each [L, H]: the target's final hidden state at every position of its sequence.
    prompt_index: list[int] = field(default_factory=list)  # Index of each sequence's prompt in the prompt list.
    prompt_len: list[int] = field(default_factory=list)  # Prompt tokens at the start of each sequence.
    temperature: list[float] = field(default_factory=list)  # Temperature of each continuation (0 = greedy).
    aux: list[torch.Tensor] = field(default_factory=list)
    """Each [L, kH] (bf16): the target's hidden states of k aux layers per position; [] = none read."""

    @property
    def num_tokens(self) -> int:
        return sum(s.numel() for s in self.sequences)


def _encode(target, prompt: Prompt | str | list[int]) -> list[int]:
    """Token ids of a chat (a one-turn chat encodes like its text), a string or a list of token ids."""
    if isinstance(prompt, tuple) and prompt and isinstance(prompt[0], dict):
        return target.encode_prompt(prompt[0]["content"] if len(prompt) == 1 else list(prompt))
    return target.encode_prompt(prompt)


CACHE_KW = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
"""The name transformers' models take their KV cache by (`cache` from 5.24, `past_key_values` before)."""


def _prefill_rows(target, encoded: list[list[int]], extra: int) -> tuple[StaticKVCache, list[torch.Tensor]]:
    """Each prompt prefilled alone into one left-padded preallocated cache of width + `extra` columns;
    returns the cache and each prompt's final hidden states [len, H]."""
    b, width = len(encoded), max(map(len, encoded))
    prompt_h = []
    keys, values = [], []  # per layer [b, kv_heads, width + extra, D], rows left-padded with zeros
    for row, e in enumerate(encoded):
        alone = KVCache()
        out = target.base(input_ids=torch.tensor([e], device=target.device), **{CACHE_KW: alone.hf}, use_cache=True)
        prompt_h.append(out.last_hidden_state[0])
        for layer, (k, v) in enumerate(alone.tensors()):
            if row == 0:  # zeros in the padding: masked, but 0 x NaN garbage would still be NaN
                shape = (b, k.shape[1], width + extra, k.shape[-1])
                keys.append(k.new_zeros(shape))
                values.append(v.new_zeros(shape))
            keys[layer][row, ..., width - len(e):width, :] = k[0]
            values[layer][row, ..., width - len(e):width, :] = v[0]
    return StaticKVCache.over(keys, values, width), prompt_h


@torch.inference_mode()
def rollout_batch(target, prompts: list[Prompt | str | list[int]], *, max_new_tokens: int, temperature: float,
                  generator: torch.Generator | None = None) -> Rollouts:
    """Let `target` continue every prompt at once (temperature 0 = greedy) in one left-padded batch over
    a preallocated cache, each prompt prefilled alone; a row ends at EOS (dropped) or `max_new_tokens`
    and leaves the batch. Hidden states come back on the CPU as float32; `prompt_index` and `aux` stay empty."""
    device = target.device
    eos = torch.tensor(sorted(target.eos_token_ids) or [-1], dtype=torch.long, device=device)
    encoded = [_encode(target, p) for p in prompts]
    b, width = len(encoded), max(map(len, encoded))
    # Worked example: lengths 3 and 5, width 5 -> mask rows [0 0 1 1 1] and [1 1 1 1 1], positions
    # [0 0 0 1 2] and [0 1 2 3 4]: every real token gets the position it has unpadded.
    mask = (torch.arange(width, device=device)[None]
            >= torch.tensor([width - len(e) for e in encoded], device=device)[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, width]
    cache, prompt_h = _prefill_rows(target, encoded, max_new_tokens)
    live = torch.arange(b)  # original row of each batch entry still generating
    last_h, last = torch.stack([x[-1] for x in prompt_h]), positions[:, -1]  # [live, H], [live]
    tokens = [[] for _ in range(b)]  # generated ids per row (EOS included)
    hidden = [[] for _ in range(b)]  # [H] per generated token fed back (all but EOS and the very last)
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
                          **{CACHE_KW: cache.hf}, use_cache=True)
        last_h = out.last_hidden_state[:, -1]  # [live, H]
        for row, vec in zip(live.tolist(), last_h.float().cpu()):
            hidden[row].append(vec)
    result = Rollouts([], [])
    for row, e in enumerate(encoded):
        keep = len(hidden[row])  # generated tokens whose hidden state exists (EOS and the last one have none)
        gen_h = torch.stack(hidden[row]) if keep else prompt_h[row][:0].float().cpu()
        result.sequences.append(torch.tensor(e + tokens[row][:keep]))
        result.hidden.append(torch.cat([prompt_h[row].float().cpu(), gen_h]))
        result.prompt_len.append(len(e))
        result.temperature.append(float(temperature))
    return result


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
    """Additive mask [n, step * n] for depth `step` (1-based): query j sees depth-1 keys 0..j and, at each deeper depth,
    only its own chain's key j. E.g. n = 3, step = 2: [[1 0 0 | 1 0 0], [1 1 0 | 0 1 0], [1 1 1 | 0 0 1]]."""
    eye = torch.eye(n, dtype=torch.bool, device=device)
    visible = torch.cat([torch.ones(n, n, dtype=torch.bool, device=device).tril()] + [eye] * (step - 1), 1)
    return torch.zeros(n, step * n, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)


def unroll(head, embed, batch: TrainBatch, depth: int, noise: float = 0.0,
           generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The head's predicted features for depths 1..depth, each [B, n, H] (n = L - 1 pairs; entry j of depth s
    predicts h_{j+s}). Depth 1 reads the true features plus uniform noise of width `noise`; deeper depths read
    the previous depth's predictions, gradients flowing through them."""
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
                 ce_weight: float, depth_decay: float = 1.0, generated_only: bool = False
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss, summed over depths with weight depth_decay**(s-1): SmoothL1(predicted, true feature) + ce_weight *
    CE over the draft vocabulary (`vocab_weight` [N, H]), each depth divided by the depth-1 positions. generated_only:
    pair j counts at depth s only if t_{j+s+1} is the target's continuation (prompt tokens are never drafted)."""
    targets = depth_targets(batch, len(predicted))
    if generated_only:  # e.g. prompt_len 3: depth 1 keeps pairs j >= 1 (t_{j+2} at index >= 3)
        targets = [(true, valid & F.pad(batch.generated[:, s + 1:], (0, s)))
                   for s, (true, valid) in enumerate(targets, start=1)]
    count = targets[0][1].sum().clamp(min=1)
    total = predicted[0].new_zeros(())
    stats: dict[str, float] = {}
    for s, (pred, (true, valid)) in enumerate(zip(predicted, targets), start=1):
        p, h = pred[valid].float(), true[valid]  # [M, H]
        regression = F.smooth_l1_loss(p, h, reduction="none").mean(-1)  # [M]
        with torch.no_grad():
            teacher_logits = F.linear(h, vocab_weight)  # [M, N]
        log_student = F.linear(p, vocab_weight).log_softmax(-1)
        ce = -(teacher_logits.softmax(-1) * log_student).sum(-1)  # [M]
        total = total + depth_decay ** (s - 1) * (regression + ce_weight * ce).sum() / count
        with torch.no_grad():
            right = log_student.argmax(-1) == teacher_logits.argmax(-1)  # [M]
            stats[f"top1@{s}"] = float(right.float().mean()) if valid.any() else 0.0
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
    """Greedy chain acceptance on target sequences: `acc@s` = P(depth s right | depths 1..s-1 right) and
    `chain_mal` = 1 + sum_s P(depths 1..s right), over pairs whose next `depth + 1` tokens are greedy."""
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
