"""The batch side of the loop: rows padded into one forward, rolled back per row, sized before any work.

Owns `prefill_rows`, `left_padded`, `verify_block`, `commit_step` and the cache memory check (`kv_bytes`,
`free_memory`, `check_memory`). Knows nothing about acceptance or drafting beyond `specdec.core.draft`'s records.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.core.draft import Acceptance, Draft, Step
from specdec.runtime.cache import Cache
from specdec.runtime.model import ForwardOut, Target


def prefill_rows(target: Target, cache: Cache, rows: Sequence[Sequence[int]]) -> Step:
    """`prefill` for a batch: every row's tokens but its last, right-padded to the longest (the
    padding slots become holes), in one forward; the B-row prefill `Step`."""
    counts = [len(r) - 1 for r in rows]
    width = max(counts)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : counts[b]] = torch.tensor(list(r[:-1]), dtype=torch.long)
    if width:
        valid = None if len(set(counts)) == 1 else torch.arange(width) < torch.tensor(counts)[:, None]
        out = target.forward(tokens, cache, valid=valid, logits_rows=slice(-1, None))
        hidden, aux = out.hidden, out.aux
    else:
        hidden = torch.empty(len(rows), 0, target.hidden_size, dtype=target.dtype, device=target.device)
        aux = hidden.new_empty(len(rows), 0, target.hidden_size * len(target.aux_layers)) if target.aux_layers else None
    token_ids, lengths = left_padded(rows)
    return Step(
        token_ids=token_ids, num_new=[len(r) for r in rows], draft=Draft.empty(len(rows)), acceptances=[],
        positions=torch.arange(width).expand(len(rows), width), target_hidden=hidden, target_aux=aux,
        _kv=lambda: cache.tail(width), lengths=lengths, kept=counts,
    )


def left_padded(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int] | None]:
    """Rows of token ids as one left-padded [B, L] tensor, and their lengths (None when all equal)."""
    lengths = [len(r) for r in rows]
    out = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, out.shape[1] - len(r):] = torch.tensor(list(r), dtype=torch.long)
    return out, None if len(set(lengths)) == 1 else lengths


def verify_block(drafts: list[Draft], roots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens [B, W], parents [W] or [B, W], valid [B, W] or None) of one verification: each row's root then its draft,
    padded to the widest row (padding: children of the block's start, never an ancestor, marked invalid)."""
    if len(drafts) == 1:
        d = drafts[0]
        tokens = torch.cat([d.tokens.new_tensor([[roots[0]]]), d.tokens], 1)  # [1, 1 + N]
        return tokens, torch.cat([torch.tensor([-1]), d.parents + 1]), None  # draft roots hang off block 0
    width = 1 + max(d.num_nodes for d in drafts)
    tokens = torch.zeros(len(drafts), width, dtype=torch.long)
    parents = torch.full((len(drafts), width), -1, dtype=torch.long)
    for b, (d, root) in enumerate(zip(drafts, roots)):
        tokens[b, 0], tokens[b, 1: d.num_nodes + 1] = root, d.tokens[0].cpu()
        parents[b, 1: d.num_nodes + 1] = d.parents + 1
    sizes = torch.tensor([d.num_nodes + 1 for d in drafts])
    valid = None if bool((sizes == width).all()) else torch.arange(width) < sizes[:, None]
    if bool((parents == parents[0]).all()):
        parents = parents[0]
    return tokens, parents, valid


def commit_step(drafts: list[Draft], acceptances: list[Acceptance], kept: list[list[int]], news: list[list[int]],
                 out: ForwardOut, token_ids: torch.Tensor, lengths: list[int] | None, cache: Cache,
                 past: int | torch.Tensor, batched: bool) -> Step:
    """The `Step` a drafter's `commit` hears after a verification (B rows; see `Step`)."""
    if not batched:
        rows = kept[0]
        return Step(
            token_ids=token_ids, num_new=[len(news[0])], draft=drafts[0], acceptances=acceptances,
            positions=torch.arange(past, past + len(rows))[None], target_hidden=out.hidden[:, rows],
            target_aux=None if out.aux is None else out.aux[:, rows], _kv=lambda n=len(rows): cache.tail(n),
        )
    width = max(len(k) for k in kept)
    index = torch.zeros(len(kept), width, dtype=torch.long)
    for b, k in enumerate(kept):
        index[b, : len(k)] = torch.tensor(k)
    gather = index.to(out.hidden.device)[..., None]
    # [B, K]; `past` is [1] when the prefill wrote nothing (every prompt one token), as is the cache
    positions = (past[:, None] + torch.arange(width)).expand(len(kept), width)
    return Step(
        token_ids=token_ids, num_new=[len(n) for n in news], draft=drafts[0], acceptances=acceptances,
        positions=positions, target_hidden=out.hidden.gather(1, gather.expand(-1, -1, out.hidden.shape[-1])),
        target_aux=None if out.aux is None else out.aux.gather(1, gather.expand(-1, -1, out.aux.shape[-1])),
        _kv=lambda: cache.tail(width), drafts=drafts, lengths=lengths, kept=[len(k) for k in kept],
    )


def kv_bytes(target: Target, rows: int, entries: int) -> int:
    """Bytes of a target KV cache holding `entries` slots for `rows` rows (keys and values, every layer)."""
    cfg = target.model.config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.empty(0, dtype=target.dtype).element_size()
    return 2 * cfg.num_hidden_layers * heads * head_dim * itemsize * rows * entries


def free_memory(device: torch.device) -> int | None:
    """Bytes free now on `device` (host: MemAvailable), None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_memory(target: Target, rows: int, entries: int) -> None:
    """ValueError, before any allocation, when a batch's cache (at its bound) would not fit in the
    memory free now (host memory on CPU, device memory on CUDA)."""
    need, free = kv_bytes(target, rows, entries), free_memory(target.device)
    if free is not None and need > free:
        raise ValueError(f"a batch of {rows} rows x {entries} cache slots needs {need / 2**30:.2f} GiB of KV cache, "
                         f"{free / 2**30:.2f} GiB is free: lower the batch, the prompt lengths or max_new_tokens")
