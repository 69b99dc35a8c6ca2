"""A causal LM wrapped for speculative decoding: tree forward, prompt encoding, decoding.

Owns `Target`: a Hugging Face causal LM and its tokenizer that scores a whole draft tree in one forward (tree mask and
per-node positions), returning logits and final hidden states per node; also the model of model drafters. Knows
nothing about acceptance; the KV cache it writes into belongs to the caller.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.core import tree as tree_ops
from specdec.runtime.cache import Cache


def tree_attention(
    parents: torch.Tensor | None, n: int, past: int, dtype: torch.dtype = torch.float32,
    next_position: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [n] and additive attention mask [n, past + n] for n new tokens after `past` cached
    entries, the cache's next absolute position being `next_position` (default `past`).

    `parents` (None = a chain) covers the *tree block*: the last len(parents) positions, i.e. the
    newest cached entries then the n new tokens, -1 meaning a child of the position before the block.
    A new token sees everything before the block and its ancestors in it, at block_start + depth - 1."""
    parents = tree_ops.chain_parents(n) if parents is None else tree_ops.as_parents(parents)
    block_start, positions, visible = tree_block(parents, n, past, next_position)  # [n], [n, M]
    if not dtype.is_floating_point:
        dtype = torch.float32
    mask = torch.zeros(n, past + n, dtype=dtype)  # [n, past + n]: the prefix before the block is visible
    mask[:, block_start:].masked_fill_(~visible, torch.finfo(dtype).min)
    return positions, mask


def tree_block(parents: torch.Tensor, n: int, past: int, next_position: int | None = None,
               ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The geometry `tree_attention` masks by, without a host sync: (stored index of the block's first entry,
    positions [n], visible [n, M]); also fills `specdec.runtime.graphs`' static buffers."""
    block = parents.numel() - n  # block entries already cached
    block_start = past - block  # stored index of the block's first entry
    if block_start < 0 or block < 0:
        raise ValueError(f"parents covers {parents.numel()} block positions but {n} tokens are new and {past} cached")
    visible = tree_ops.ancestor_mask(parents)[-n:]  # [n, M]
    first_position = (past if next_position is None else next_position) - block
    return block_start, first_position + visible.sum(1) - 1, visible  # depth = ancestors incl. itself


def batch_attention(
    parents: torch.Tensor | None, n: int, past: int, next_positions: torch.Tensor,
    valid: torch.Tensor | None = None, new_valid: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree_attention` for B rows: positions [B, n] and additive mask [B, 1, n, past + n]. `parents` is
    None (a chain), [M] or [B, M]; row b's block sits at `next_positions[b]`. `valid` [B, past] and
    `new_valid` [B, n] mark real entries: holes are masked for every query, a padding token sees itself only."""
    rows = next_positions.shape[0]
    if parents is None:
        parents = tree_ops.chain_parents(n)
    parents = torch.as_tensor(parents, dtype=torch.long).cpu()
    if not dtype.is_floating_point:
        dtype = torch.float32
    shared = parents.dim() == 1
    keys = torch.ones(rows, past + n, dtype=torch.bool)  # [B, past + n] which entries are real
    if valid is not None:
        keys[:, :past] = valid
    if new_valid is not None:
        keys[:, past:] = new_valid.to(torch.bool).cpu()
    positions = torch.empty(rows, n, dtype=torch.long)
    seen = torch.empty(rows, n, past + n, dtype=torch.bool)
    for row in range(rows):
        row_parents = parents if shared else tree_ops.as_parents(parents[row])
        if row == 0 or not shared:
            block_start, depth_positions, visible = tree_block(row_parents, n, past, 0)
        positions[row] = depth_positions + int(next_positions[row])
        seen[row, :, :block_start] = True
        seen[row, :, block_start:] = visible
    seen &= keys[:, None, :]
    seen[:, torch.arange(n), past + torch.arange(n)] = True  # every query sees itself
    mask = torch.zeros(rows, 1, n, past + n, dtype=dtype)
    mask.masked_fill_(~seen[:, None], torch.finfo(dtype).min)
    return positions, mask


def is_chain(parents: torch.Tensor | Sequence[int], n: int) -> bool:
    """True when `parents` over a block of n new tokens is a plain chain after everything cached
    ([-1, 0, ..., n-2]: no cached entry in the block, each token the child of the one before)."""
    parents = torch.as_tensor(parents)
    return parents.numel() == n and torch.equal(parents.cpu(), tree_ops.chain_parents(n))


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, N, V] (or [B, len(logits_rows), V])
    hidden: torch.Tensor  # [B, N, H] final hidden state (after the final norm), lm_head input
    aux: torch.Tensor | None = None  # [B, N, kH] hidden states of the target's `aux_layers`, None when it has none


@dataclass
class Target:
    """A causal LM ready for tree forwards. Build with `specdec.load_target`."""

    model: Any  # transformers PreTrainedModel (causal LM)
    tokenizer: Any | None
    name: str  # The model's name (a built-in name, path or hub id), never decorated with its quantization.
    quant: str = "none"  # The quantization spec its weights carry (`specdec.quant`), `none` when loaded as is.
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form facts about how it was loaded (source file, quantization report, ...)."""
    kernel: str = "torch"
    """The kernel its plain linear layers run with (`specdec.runtime.kernels`: `torch`, `onednn`); set by
    `specdec.runtime.kernels.use_kernel` (`load_target(kernel=...)`), never by changing this field."""
    aux_layers: tuple[int, ...] = ()
    """Hidden-state indices (k = after decoder layer k) every forward also returns as `ForwardOut.aux`,
    for drafters that read more than the final layer (EAGLE-3 fusion); set with `capture_layers`."""

    def __post_init__(self) -> None:
        self.model.eval()
        self.base = self.model.base_model
        self.lm_head = self.model.get_output_embeddings()
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)
        head = self.lm_head
        self.pair_one_row = type(head) is torch.nn.Linear and head.bias is None and pairs_faster(head.weight)

    def __repr__(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        return (f"Target({self.name!r}, dtype={str(self.dtype).replace('torch.', '')}, device={self.device}, "
                f"quant={self.quant!r}, kernel={self.kernel!r}, parameters={params / 1e6:.1f}M, vocab={self.vocab_size})")

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """`name`, or `name@quant` for a quantized target: for messages and result keys."""
        return self.name if self.quant == "none" else f"{self.name}@{self.quant}"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def attention(self) -> str:
        """The transformers attention function its forwards run (`specdec_sdpa` by default: `specdec.runtime.attention`)."""
        return str(getattr(self.model.config, "_attn_implementation", None) or "default")

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head.weight.shape[1]

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + generated) this model is run on. Sliding-window models are
        limited to their window, since the cache here keeps full attention."""
        cfg = self.model.config.get_text_config()
        limits = [getattr(cfg, "max_position_embeddings", None) or 2048]
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            limits.append(cfg.sliding_window)
        return int(min(limits))

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    # ---- text ----------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string (chat template applied when `chat` and the tokenizer has
        one), a list of chat messages ({"role", "content"} dicts), or a list of token ids as is."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        accepted = "a string, chat messages ({'role', 'content'} dicts) or a list of token ids"
        if not isinstance(prompt, (str, list, tuple)):
            raise TypeError(f"prompt must be {accepted}, got {type(prompt).__name__} {prompt!r:.40}")
        kinds = {type(t).__name__ for t in prompt} if not isinstance(prompt, str) else set()
        if len(kinds) > 1 or kinds - {"int", "dict"}:
            raise TypeError(f"prompt must be {accepted}: a list mixes or holds {', '.join(sorted(kinds))}")
        if len(prompt) == 0:
            raise ValueError("the prompt is empty: give a non-empty string, chat messages or token ids")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            if self.tokenizer is None:
                raise ValueError(f"target {self.name!r} has no tokenizer: give the prompt as a list of token ids")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if chat and getattr(self.tokenizer, "chat_template", None):
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                ids = list(ids)
            elif isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            else:
                raise ValueError("a list of chat messages needs a tokenizer with a chat template (chat=True)")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token (a non-empty string or id list)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, token_ids))
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def capture_layers(self, layers: Sequence[int]) -> None:
        """Make every later forward return the hidden states of `layers` (`ForwardOut.aux`, and so
        `Step.target_aux`). A target serves one such set: ValueError if another was asked for."""
        layers = tuple(int(k) for k in layers)
        if self.aux_layers and layers and layers != self.aux_layers:
            raise ValueError(f"target {self.label!r} already captures hidden states {list(self.aux_layers)}; "
                             f"a second drafter asked for {list(layers)}")
        self.aux_layers = layers or self.aux_layers

    # ---- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, n] long, the new tokens
        cache: Cache,
        parents: torch.Tensor | None = None,  # [M] or [B, M] long, M >= n: parents over the tree block
        logits_rows: slice | torch.Tensor | None = None,
        valid: torch.Tensor | None = None,  # [B, n] bool: which new tokens are real (None = all)
    ) -> ForwardOut:
        """Score n new tokens after the cache, appending exactly n entries at `cache.next_position`.

        Without `parents` (or with chain parents) the tokens are a causal chain; with them, a tree block
        (`tree_attention`). `logits_rows` selects which rows get logits; `hidden` and `aux` cover every row.
        Batches: each row at its own `cache.next_positions`, `parents` [B, M] may differ per row, padding
        (`valid` False) becomes holes, masked by `batch_attention`."""
        batch, n = tokens.shape
        holes = getattr(cache, "valid", None) is not None or valid is not None
        if batch > 1 or holes or (parents is not None and parents.dim() == 2):
            return self._forward_rows(tokens, cache, parents, logits_rows, valid, holes)
        if parents is not None and is_chain(parents, n):
            parents = None
        if parents is None:
            # A chain after everything cached: the model's own causal masking is the tree mask. It builds
            # no mask where HF `generate` builds none (one new token, or an empty cache: SDPA then runs
            # unmasked, a prefill causally over half the scores) instead of a [n, past + n] mask read by
            # every layer. Positions still come from the cache; the mask needs only stored entries.
            start = cache.next_position
            positions, mask = torch.arange(start, start + n), None  # [n]
        else:
            dtype = self.base.get_input_embeddings().weight.dtype
            positions, mask = tree_attention(parents, n, cache.length, dtype, cache.next_position)
            mask = mask[None, None].to(self.device)  # [B, 1, n, past + n]
        return self._run(tokens, cache, positions[None], mask, logits_rows)

    def _forward_rows(self, tokens: torch.Tensor, cache: Cache, parents: torch.Tensor | None,
                      logits_rows: slice | torch.Tensor | None, valid: torch.Tensor | None, holes: bool) -> ForwardOut:
        """`forward` for a batch or a cache with holes (see there)."""
        batch, n = tokens.shape
        starts = cache.next_positions
        starts = starts.expand(batch) if starts.numel() == 1 else starts
        if parents is not None and parents.dim() == 2 and bool((parents == parents[0]).all()):
            parents = parents[0]
        chain = parents is None or (parents.dim() == 1 and is_chain(parents, n))
        if chain and not holes:
            positions, mask = starts[:, None] + torch.arange(n), None  # the model's causal mask suffices
        else:
            dtype = self.base.get_input_embeddings().weight.dtype
            positions, mask = batch_attention(parents, n, cache.length, starts, getattr(cache, "valid", None),
                                              valid, dtype)
            mask = mask.to(self.device)
        out = self._run(tokens, cache, positions, mask, logits_rows)
        if holes:
            cache.append_valid(valid, n)
        return out

    def _run(self, tokens: torch.Tensor, cache: Cache, positions: torch.Tensor, mask: torch.Tensor | None,
             logits_rows: slice | torch.Tensor | None) -> ForwardOut:
        """The model's forward at `positions` [B, n] under `mask` (None = its own causal mask)."""
        out = self.base(
            input_ids=tokens.to(self.device),
            attention_mask=mask,
            position_ids=positions.to(self.device),  # [B, n]
            cache=cache.hf,
            use_cache=True,
            output_hidden_states=bool(self.aux_layers),
        )
        hidden = out.last_hidden_state  # [B, n, H]
        rows = hidden if logits_rows is None else hidden[:, logits_rows]
        logits = self.logits(rows)
        aux = torch.cat([out.hidden_states[k] for k in self.aux_layers], -1) if self.aux_layers else None
        return ForwardOut(logits=logits, hidden=hidden, aux=aux)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The lm_head (and soft-capping) on hidden states [B, n, H] -> logits [B, n, V]; a bias-free head as
        W @ rows^T (faster at small n on one thread; may round differently in the last bit), one row paired with
        itself where that measured faster (`pair_one_row`)."""
        head = self.lm_head
        if type(head) is torch.nn.Linear and head.bias is None:
            flat = rows.reshape(-1, rows.shape[-1])  # [B*n, H]
            logits = rows_product(head.weight, flat, self.pair_one_row).reshape(*rows.shape[:-1], -1)  # [B, n, V]
        else:
            logits = head(rows)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def prefill(self, token_ids: Sequence[int], cache: Cache) -> ForwardOut:
        """Run `token_ids` as a chain into `cache`, logits for the last row only."""
        tokens = torch.tensor([list(token_ids)], dtype=torch.long)
        return self.forward(tokens, cache, logits_rows=slice(-1, None))


def rows_product(weight: torch.Tensor, flat: torch.Tensor, pair: bool = False) -> torch.Tensor:
    """Rows [n, H] scored by `weight` [V, H] as W @ rows^T -> [n, V]; one row paired with a copy of itself
    when `pair` (`pairs_faster`)."""
    n = flat.shape[0]
    return (weight @ (flat.expand(2, -1) if pair and n == 1 else flat).T)[:, :n].T


def pairs_faster(weight: torch.Tensor, repeats: int = 5) -> bool:
    """Whether a half-precision CPU `weight` [V, H] scores one row faster as two (the row and a copy: a GEMM, whose
    first column is the row's logits) than alone (a GEMV, which oneDNN runs slowly on some CPUs), with the same bits
    on a probe row: timed once here, interleaved, best of `repeats`. fp32 weights and other devices keep one row."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    one = torch.randn(weight.shape[1], 1, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    best = {1: float("inf"), 2: float("inf")}
    with torch.no_grad():
        if not torch.equal(weight @ one, (weight @ one.expand(-1, 2))[:, :1]):
            return False  # a choice of speed only: never one that changes the logits
        for _ in range(repeats + 1):
            for n in best:
                start = time.perf_counter()
                weight @ one.expand(-1, n)
                best[n] = min(best[n], time.perf_counter() - start)
    return best[2] < 0.9 * best[1]
