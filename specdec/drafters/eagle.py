"""EAGLE drafting: a one-layer head over the target's own features drafts in any shape.

Owns `EagleDrafter` and its registration as `eagle`. The head (`EagleHead`, own KV cache) runs over pairs
(feature at position i, embedding of token i+1), the features being the target's final hidden states from each
committed `Step` (`Step.target_hidden`, `Step.target_aux` for EAGLE-3); deeper nodes read their parent's predicted
feature. `refresh=True` (the default) re-runs the accepted tokens with the target's true features; `refresh=False`
keeps the accepted path's entries. `draft_vocab=N` scores only the head's N most frequent tokens (`SubVocab`);
`head=DIR` loads a Speculators EAGLE-3 head (aux layers only, its own lm_head).
`head_dtype="auto"` reads the dtype `python -m specdec.tune` stored, else the target's.
Knows nothing about verification; the target's lm_head and embedding are shared, never copied or trained.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from specdec import machine
from specdec.runtime import kernels
from specdec.runtime.cache import KVCache
from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.registry import register
from specdec.drafters.eagle_head import EagleHead, HeadConfig
from specdec.drafters.speculators_format import Eagle3Head, is_speculators_dir, load_speculators
from specdec.drafters.common import BlockSlots
from specdec.drafters.lockstep import Ask, grow_rows
from specdec.loading import parse_dtype
from specdec.quant.registry import get as quant_backend, parse_spec
from specdec.runtime.model import Target, batch_attention, pairs_faster, rows_product, tree_attention
from specdec.core.grow import SubVocab, grow_tree

HEADS_DIR = Path(__file__).parent / "heads"
"""Shipped heads: `<target name>.safetensors` + `<target name>.json`."""


class EagleDrafter:
    """Drafts with an EAGLE head over `target`'s features (see the module docstring)."""

    def __init__(self, head: EagleHead | Eagle3Head, *, target: Target, draft_vocab: int | None = None,
                 refresh: bool = True, head_dtype: torch.dtype | None = None, name: str = "eagle",
                 head_quant: bool = False) -> None:
        head.config.check_target(target)
        self.name = name
        self.batchable = getattr(head, "takes_row_positions", False)  # its forward runs rows at their own positions
        self.refresh = refresh
        # A copy, cast and given the target's linear kernel: the caller's head may still be trained, or
        # be built into drafters of other dtypes (`specdec.tune.measure_head_dtypes`), and must not change under them.
        # A dtype the kernel does not pack on this CPU (bf16 under oneDNN without AVX-512) stays on F.linear.
        self.head = copy.deepcopy(head).to(device=target.device, dtype=head_dtype or target.dtype).eval()
        if head_quant and (spec := parse_spec(target.quant)).backend != "none":  # the head in the target's quantization
            self.head = quant_backend(spec.backend).apply(self.head, spec)
        elif target.kernel != "torch":
            kernels.apply_kernel(self.head, target.kernel)
        self.embed = self.head.embedding(target)
        self.lm_weight = target.lm_head.weight  # [V, H]
        self.softcap = None if head.scores_own_vocabulary else target.softcap
        self.hidden_size = target.hidden_size
        self.aux_layers = head.config.aux_layers
        if self.aux_layers:
            target.capture_layers(self.aux_layers)
        self.vocab = None  # [N] target ids scored by the draft, None = all
        self.sub_vocab: SubVocab | None = None  # the same, as the growers take it
        if head.scores_own_vocabulary:  # a speculators EAGLE-3 head: its lm_head, its d2t map
            self._own_vocabulary(head, target, draft_vocab)
            self.reset()
            return
        if draft_vocab is not None:
            stored = int(head.draft_vocab.numel())
            if not isinstance(draft_vocab, int) or draft_vocab < 1:
                raise ValueError(f"draft_vocab must be an integer >= 1 (None = full vocabulary), got {draft_vocab!r}")
            if draft_vocab > target.vocab_size:
                raise ValueError(f"draft_vocab={draft_vocab} > the vocabulary of {target.name!r} ({target.vocab_size})")
            if draft_vocab > stored:
                raise ValueError(f"draft_vocab={draft_vocab} but the head ranks only {stored} tokens; "
                                 f"use draft_vocab <= {stored} or None (full vocabulary)")
            self.vocab = head.draft_vocab[:draft_vocab].to(target.device)
            self.sub_vocab = SubVocab(self.vocab, target.vocab_size)
            self.vocab_weight = self.lm_weight[self.vocab].detach()  # [N, H]
        if head_dtype is not None and head_dtype != self.lm_weight.dtype:  # the drafts' own copy of the rows they score
            if self.vocab is None:
                self.lm_weight = self.lm_weight.detach().to(head_dtype)
            else:
                self.vocab_weight = self.vocab_weight.to(head_dtype)
        self.score_weight = self.lm_weight if self.vocab is None else self.vocab_weight  # [N, H]
        self.scorer = kernels.linear_over(self.score_weight, target.kernel)  # None: W @ x^T below
        self.pair_one_row = self.scorer is None and pairs_faster(self.score_weight)
        self.reset()

    def _own_vocabulary(self, head: Eagle3Head, target: Target, draft_vocab: int | None) -> None:
        """Score with the head's own lm_head copy over its draft columns (target ids `head.draft_vocab`)."""
        size = int(head.draft_vocab.numel())
        if draft_vocab is not None and draft_vocab != size:
            raise ValueError(f"this EAGLE-3 head scores its own draft vocabulary of {size} tokens (its d2t map); "
                             f"draft_vocab must be None or {size}, got {draft_vocab!r}")
        if not torch.equal(head.draft_vocab, torch.arange(target.vocab_size)):
            self.vocab = head.draft_vocab.to(target.device)
            self.sub_vocab = SubVocab(self.vocab, target.vocab_size)
        self.score_weight = self.head.lm_head.weight.detach()  # [N, H] in the head's dtype
        self.scorer = kernels.linear_over(self.score_weight, target.kernel)
        self.pair_one_row = self.scorer is None and pairs_faster(self.score_weight)

    def reset(self) -> None:
        self.cache = KVCache()
        self.consumed = 0  # pairs whose KV is in self.cache (pair i = feature i + token i+1)
        width = self.hidden_size * (1 + len(self.aux_layers))
        self.features = self.lm_weight.new_empty(1, 0, width)  # [B, P, (1 + k) H] target features (final,
        # then aux layers) of the positions consumed, consumed + 1, ...: pairs not yet run by the head
        self.block = BlockSlots()
        self.block_features = self.features[..., :self.hidden_size]  # [B, 1 + M, H]: root's predicted feature, then block entries'

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits [B, n, N] (float32) of predicted features [B, n, H] over the draft vocabulary
        (column j = token `self.vocab[j]`; N = V without a draft vocabulary)."""
        weight = self.score_weight  # [N, H]
        features = self.head.logit_features(features)
        flat = features.reshape(-1, features.shape[-1]).to(weight.dtype)  # [B*n, H]
        rows = self.scorer(flat) if self.scorer is not None else rows_product(weight, flat, self.pair_one_row)
        logits = rows.reshape(*features.shape[:-1], -1)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def _run(self, features: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
        """Append n pairs (features [B, n, H], tokens [B, n]) to the head's cache; predicted features [B, n, H]."""
        positions, mask = tree_attention(parents, tokens.shape[1], self.cache.length, self.head.fc.weight.dtype)
        embeds = self.embed(tokens.to(self.lm_weight.device))  # [B, n, H]
        return self.head(features, embeds, positions, mask, self.cache.hf)

    def _score(self, node_ids: list[int], tokens: torch.Tensor, parent_ids: list[int]) -> torch.Tensor:
        # Row 0 of block_features is the root's predicted feature, row s + 1 block slot s's.
        rows = torch.tensor([self.block.slot[p] + 1 if p >= 0 else 0 for p in parent_ids])
        feats = self.block_features.index_select(1, rows.to(self.block_features.device))  # [B, n, H]
        parents = self.block.add(node_ids, parent_ids)
        predicted = self._run(feats, tokens, parents)  # [B, n, H]
        self.block_features = torch.cat([self.block_features, predicted], 1)
        return self._logits(predicted)

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        ids = request.token_ids  # [B, L]
        if ids.shape[0] != 1:
            raise NotImplementedError(f"the EAGLE drafter supports batch size 1 only, got {ids.shape[0]}")
        pairs = ids.shape[1] - 1
        if pairs == 0:  # a one-token prompt: no target feature exists yet, so nothing to draft from
            return Draft.empty(device=ids.device)
        if self.consumed + self.features.shape[1] != pairs:
            raise ValueError(f"EAGLE holds features for {self.consumed + self.features.shape[1]} positions but "
                             f"{pairs + 1} tokens are committed: every Step must reach commit()")
        tokens = ids[:, self.consumed + 1:]  # [B, n] the token after each pending feature
        predicted = self._run(self.features, tokens, None)
        self.consumed = pairs
        self.features = self.features[:, :0]
        self.root_feature = predicted[:, -1:]  # [B, 1, H] predicted feature of the root
        self.block, self.block_features = BlockSlots(), self.root_feature
        return grow_tree(request.shape, self._logits(self.root_feature)[:, -1], self._score,
                         request.sampling, request.generator, request.max_depth, self.sub_vocab)

    def commit(self, step: Step) -> None:
        """Roll the head's cache back (refresh: drop every draft entry; else keep the accepted path's)
        and queue the target's features of the committed positions that the head has not run."""
        if step.kept is not None:
            self._commit_rows(step)
            return
        if not step.is_prefill:
            kept = [] if self.refresh else self.block.accepted(step)
            self.cache.keep(self.consumed, kept)
            self.consumed += len(kept)
        first = int(step.positions[0, 0]) if step.positions.numel() else self.consumed
        features = self._step_features(step)  # [B, K, W] at positions first, first + 1, ...
        self.features = torch.cat([self.features, features[:, max(0, self.consumed - first):]], 1)

    def _step_features(self, step: Step) -> torch.Tensor:
        """The target's features of a step's kept rows, [B, K, W]: final hidden states, then the aux layers'."""
        features = step.target_hidden  # [B, K, H]
        if self.aux_layers:
            if step.target_aux is None:
                raise ValueError(f"the EAGLE head fuses target layers {list(self.aux_layers)} but the Step carries "
                                 "no target_aux: the target must capture them (Target.capture_layers)")
            features = torch.cat([features, step.target_aux], -1)  # [B, K, (1 + k) H]
        return features.to(self.features.dtype)

    # ---- batches (`specdec.generate_batch`) ------------------------------------------------------
    # Row b's pairs sit in row b of one head cache at row b's own positions (pair i at position i);
    # rows that ran fewer pairs have holes there (`specdec.runtime.cache.RowBook`). A draft block is
    # padded per depth to the widest row, its padding entries are holes, and a row's block slot s is
    # block column s in every row's `BlockSlots` (padding columns included).

    def _start_rows(self, rows: int) -> None:
        """Batch state for `rows` rows, at the prefill of a batch."""
        self.cache = KVCache()
        self.row_consumed = [0] * rows  # pairs of row b in the head's cache
        self.row_features = [self.features[0, :0]] * rows  # [P_b, W] row b's target features not yet run
        self.row_blocks = [BlockSlots() for _ in range(rows)]
        self.block_begin = 0  # stored index of the draft block in the head's cache (= length: no block)

    def _run_rows(self, features: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None,
                  valid: torch.Tensor | None) -> torch.Tensor:
        """Append n entries per row (features [B, n, W], tokens [B, n], block parents [B, M] or None = a
        chain, valid [B, n]: False = padding, a hole) at each row's next position; predicted features [B, n, H]."""
        rows, n = tokens.shape
        starts = self.cache.next_positions
        starts = starts.expand(rows) if starts.numel() == 1 else starts  # [B] ([1] before the first write)
        positions, mask = batch_attention(parents, n, self.cache.length, starts, self.cache.valid, valid,
                                          self.head.fc.weight.dtype)  # [B, n], [B, 1, n, past + n]
        embeds = self.embed(tokens.to(self.lm_weight.device))  # [B, n, H]
        predicted = self.head(features, embeds, positions, mask, self.cache.hf)
        self.cache.append_valid(valid, n)
        return predicted

    def _score_rows(self, asks: dict[int, Ask]) -> dict[int, torch.Tensor]:
        """One depth of every asking row's draft in one head forward (`grow_rows`' ScoreRows).

        Example: row 0 asks nodes [3, 4] under parents [1, 1], row 1 asks nothing: the block gains
        two columns; row 0's nodes read the predicted feature of node 1's column, row 1's columns
        are padding (parent -1, holes), and only row 0 gets logits back."""
        rows, width = len(self.row_blocks), max(len(nodes) for nodes, _, _ in asks.values())
        reads = torch.zeros(rows, width, dtype=torch.long)  # [B, n] column of block_features each node reads
        tokens = torch.zeros(rows, width, dtype=torch.long)  # [B, n]
        for b, block in enumerate(self.row_blocks):
            nodes, row_tokens, parent_ids = asks.get(b, ([], None, []))
            if nodes:  # column 0 of block_features is the root's predicted feature, column s + 1 block slot s's
                reads[b, :len(nodes)] = torch.tensor([block.slot[p] + 1 if p >= 0 else 0 for p in parent_ids])
                tokens[b, :len(nodes)] = row_tokens[0].cpu()
            block.add(nodes, parent_ids)
            block.parents.extend([-1] * (width - len(nodes)))  # padding: no one's ancestor
        counts = torch.tensor([len(asks.get(b, ([],))[0]) for b in range(rows)])
        valid = torch.arange(width) < counts[:, None]  # [B, n]
        parents = torch.tensor([block.parents for block in self.row_blocks], dtype=torch.long)  # [B, M]
        reads = reads.to(self.block_features.device)[..., None].expand(-1, -1, self.block_features.shape[-1])
        predicted = self._run_rows(self.block_features.gather(1, reads), tokens, parents,
                                   None if bool(valid.all()) else valid)
        self.block_features = torch.cat([self.block_features, predicted], 1)
        logits = self._logits(predicted)  # [B, n, N]
        return {b: logits[b:b + 1, :len(nodes)] for b, (nodes, _, _) in asks.items()}

    @torch.inference_mode()
    def propose_batch(self, request: DraftRequest) -> list[Draft]:
        """One draft per row: every row's pending pairs in one head forward, then one forward per depth
        for all rows (`grow_rows`); row b samples only from `request.generators[b]`."""
        rows, width = request.token_ids.shape
        lengths = request.lengths or [width] * rows
        if rows != len(self.row_features):
            raise ValueError(f"EAGLE holds {len(self.row_features)} batch rows but the request has {rows}: "
                             "every Step must reach commit() and finished rows leave by select_rows()")
        counts = [f.shape[0] for f in self.row_features]
        for b, (consumed, count, length) in enumerate(zip(self.row_consumed, counts, lengths)):
            if consumed + count != length - 1:
                raise ValueError(f"EAGLE holds features for {consumed + count} positions of row {b} but "
                                 f"{length} tokens are committed: every Step must reach commit()")
        # 1. The pairs each row committed since its last draft: (target feature i, token i + 1).
        n = max(counts)
        features = self.features.new_zeros(rows, n, self.features.shape[-1])  # [B, n, W]
        tokens = torch.zeros(rows, n, dtype=torch.long)  # [B, n]
        for b, (consumed, count, length) in enumerate(zip(self.row_consumed, counts, lengths)):
            start = width - length + consumed + 1  # row b's token consumed + 1, left padding skipped
            features[b, :count] = self.row_features[b]
            tokens[b, :count] = request.token_ids[b, start:start + count].cpu()
        if n:
            valid = torch.arange(n) < torch.tensor(counts)[:, None]  # [B, n]
            predicted = self._run_rows(features, tokens, None, None if bool(valid.all()) else valid)
            last = (torch.tensor(counts) - 1).clamp(min=0).to(predicted.device)
            self.root_feature = predicted[torch.arange(rows, device=predicted.device), last][:, None]  # [B, 1, H]
        self.row_consumed = [c + count for c, count in zip(self.row_consumed, counts)]
        self.row_features = [f[:0] for f in self.row_features]
        self.block_begin = self.cache.length
        self.row_blocks = [BlockSlots() for _ in range(rows)]
        if not n:  # only one-token prompts: no target feature exists yet, so nothing to draft from
            return [Draft.empty(device=request.token_ids.device) for _ in range(rows)]
        # 2. Every row grows its own tree from its own scores, the rows' depths run together.
        self.block_features = self.root_feature
        root_logits = self._logits(self.root_feature)[:, -1]  # [B, N]
        rows_asked = [request.row(b) for b in range(rows)]  # each row's own generator and depth limit
        roots = [root_logits[b:b + 1] if counts[b] and r.max_depth >= 1 else None for b, r in enumerate(rows_asked)]
        return grow_rows(request.shape, roots, self._score_rows, request.sampling, [r.generator for r in rows_asked],
                         [r.max_depth for r in rows_asked], self.sub_vocab)

    def _commit_rows(self, step: Step) -> None:
        """`commit` for a batch: per-row rollback of the head's cache (`keep_rows`), per-row features queued."""
        if step.is_prefill:
            self._start_rows(step.batch)
        else:
            kept = [[] if self.refresh else block.accepted(step.row(b)) for b, block in enumerate(self.row_blocks)]
            self.cache.keep_rows(self.block_begin, kept)
            self.row_consumed = [c + len(k) for c, k in zip(self.row_consumed, kept)]
        self.block_begin = self.cache.length
        self.row_blocks = [BlockSlots() for _ in range(step.batch)]
        features = self._step_features(step)  # [B, K, W], row b's first step.kept[b] real
        for b, consumed in enumerate(self.row_consumed):
            first = int(step.positions[b, 0]) if step.kept[b] else consumed
            new = features[b, max(0, consumed - first):step.kept[b]]
            self.row_features[b] = torch.cat([self.row_features[b], new])

    def select_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows `rows` (finished rows leave), in the head's cache and its queues."""
        self.cache.select_rows(rows)
        self.row_consumed = [self.row_consumed[b] for b in rows]
        self.row_features = [self.row_features[b] for b in rows]
        self.row_blocks = [self.row_blocks[b] for b in rows]
        self.block_begin = self.cache.length


def shipped_head_path(target: Target) -> Path:
    """The shipped head for `target` (by model name: a quantized target gets its model's head, trained
    on the unquantized target's features); FileNotFoundError naming the shipped ones if none."""
    path = HEADS_DIR / f"{target.name}.safetensors"
    if not path.exists():
        shipped = sorted(p.stem for p in HEADS_DIR.glob("*.safetensors"))
        raise FileNotFoundError(f"no EAGLE head ships for target {target.name!r} (shipped: "
                                f"{', '.join(shipped) or 'none'}); train one with `python -m specdec.training` "
                                "(specdec/training/LOG.md) and pass head=PATH, or head='random' for an untrained head")
    return path


def random_head(target: Target, seed: int = 0) -> EagleHead:
    """An untrained head for `target` (for tests), its draft vocabulary ranked by token id."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return EagleHead(HeadConfig.for_target(target, draft_vocab_size=target.vocab_size),
                         draft_vocab=torch.arange(target.vocab_size))


HEAD_DTYPES = (torch.float32, torch.bfloat16)
"""What `head_dtype="auto"` chooses among for a float32 target on a CPU (`specdec.tune` measures them)."""


def head_geometry(target: Target, head: EagleHead | Eagle3Head, draft_vocab: int | None) -> str:
    """The key of a head-dtype choice in the target's tune record: what changes its timing."""
    if head.scores_own_vocabulary:
        return f"{target.kernel}-h{target.hidden_size}-v{head.draft_vocab.numel()}-e3l{len(head.layers)}"
    return f"{target.kernel}-h{target.hidden_size}-v{draft_vocab or target.vocab_size}-a{len(head.config.aux_layers)}"


def choose_head_dtype(target: Target, head: EagleHead, draft_vocab: int | None) -> tuple[torch.dtype, bool]:
    """`head_dtype="auto"`: (dtype, tuned). The dtype stored for this head geometry in the machine's
    tune record (`python -m specdec.tune TARGET --drafter eagle`), else the target's dtype (not tuned).
    Looks up only; a stored dtype that is not one of HEAD_DTYPES is a TuneError naming the record."""
    tuned = (machine.load_record(target.label, target.device, target.dtype) or {}).get("head_dtype", {})
    entry = tuned.get(head_geometry(target, head, draft_vocab))
    if entry is None:
        return target.dtype, False
    names = {str(dtype).removeprefix("torch."): dtype for dtype in HEAD_DTYPES}
    if entry.get("dtype") not in names:
        path = machine.record_path(target.label, target.device, target.dtype)
        raise machine.TuneError(f"tune record {path} stores head dtype {entry.get('dtype')!r}, expected one of "
                                f"{', '.join(names)}; run `python -m specdec.tune {target.name} --drafter eagle` again")
    return names[entry["dtype"]], True


DEFAULT_DRAFT_VOCAB = 4096
"""`draft_vocab="auto"` uses this many tokens when the head ranks at least that many (else the full
vocabulary): scoring 4,096 rows instead of the whole lm_head cuts draft time several-fold for a small
loss of acceptance (`scripts/bench_eagle.py` measures both)."""


@register("eagle")
def build_eagle(*, target: Target, head: str | Path | EagleHead | Eagle3Head | None = None,
                draft_vocab: int | str | None = "auto", refresh: bool = True,
                head_dtype: str | torch.dtype | None = "auto", head_quant: bool = False) -> EagleDrafter:
    """EAGLE drafter. head: None = the head shipped for this target, a `.safetensors` head path (with
    its `.json`), a speculators EAGLE-3 checkpoint directory, 'random' = untrained, or an EagleHead /
    Eagle3Head. draft_vocab: score only the N most frequent training tokens (None = full vocabulary;
    "auto" = DEFAULT_DRAFT_VOCAB when the head ranks that many); an EAGLE-3 head always scores its own
    draft vocabulary (None, "auto" or its size). refresh: see the module docstring. head_dtype: the dtype
    the head and the rows it scores run in: "auto" (the one `python -m specdec.tune` stored, else the
    target's; `drafter.head_dtype_tuned` says which), None = the target's, or a dtype. head_quant: the head's
    linears in the target's own quantization spec. Drafts only: exactness does not depend on them."""
    auto_dtype = isinstance(head_dtype, str) and head_dtype == "auto"
    head_dtype = None if auto_dtype else parse_dtype(head_dtype)
    if head is None:
        head = EagleHead.load(shipped_head_path(target))
    elif isinstance(head, str) and head == "random":
        head = random_head(target)
    elif isinstance(head, (str, Path)):
        head = load_speculators(head) if is_speculators_dir(head) else EagleHead.load(head)
    elif not isinstance(head, (EagleHead, Eagle3Head)):
        raise TypeError(f"head must be None, a path, 'random', an EagleHead or an Eagle3Head, "
                        f"got {type(head).__name__}")
    if draft_vocab == "auto" and head.scores_own_vocabulary:
        draft_vocab = None
    elif draft_vocab == "auto":
        draft_vocab = DEFAULT_DRAFT_VOCAB if head.draft_vocab.numel() >= DEFAULT_DRAFT_VOCAB else None
    tuned = None
    if auto_dtype:
        head_dtype, tuned = choose_head_dtype(target, head, draft_vocab)
    drafter = EagleDrafter(head, target=target, draft_vocab=draft_vocab, refresh=refresh, head_dtype=head_dtype,
                           head_quant=head_quant)
    drafter.head_dtype_tuned = tuned
    return drafter


build_eagle.test_options = {"head": "random"}
