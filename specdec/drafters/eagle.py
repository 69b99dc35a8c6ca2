"""EAGLE drafting: a one-layer head over the target's own features drafts in any shape.

Owns `EagleDrafter` and its registration as `eagle`. The drafter runs an `EagleHead`
(specdec/drafters/eagle_head.py) with its own KV cache over *pairs*: pair i is (feature at position
i, embedding of token i+1), so L committed tokens give L-1 pairs, whose features are the target's
final hidden states, taken from each `Step` the loop commits (`Step.target_hidden`) and held here
until the head has run them (with a head that fuses aux layers, EAGLE-3, the target also returns
those layers' hidden states, `Step.target_aux`, and they travel with the final ones). The head's output at the last pair
predicts the root's feature, scored by the target's frozen lm_head: the root's next-token logits.
Deeper draft nodes use the head's own predicted feature of their parent in place of the target's,
and each expanded level is one tree forward of the head (`specdec.target.model.tree_attention`).

Rollback (`refresh=True`, EAGLE's recipe and the default): the head's entries for draft nodes were
computed from *predicted* features, so all are dropped and the accepted tokens are re-run at the next
`propose` with the target's true features. `refresh=False` keeps the accepted path's entries instead
(keep-path rollback by node id, as in ModelDrafter): one pair per step instead of k+1, at the price
of stale features in the head's context.

Draft vocabulary: `draft_vocab=N` scores only the N most frequent tokens of the head's training
data (EAGLE-3): logits stay N wide, and `grow_tree` ranks and samples within them and maps the
chosen columns back to token ids (`SubVocab`); no full-vocabulary tensor is built. Knows nothing
about verification; the target's lm_head and embedding are shared, never copied or trained (the rows
a draft scores are copied only when the head runs in another dtype than the target).

Speculators EAGLE-3 heads (`Eagle3Head`, specdec/drafters/speculators_format.py; `head=DIR`) run in the
same loop: they read only the aux layers of the target's features, feed their own residual stream to
deeper nodes, and score with their own lm_head over their d2t draft vocabulary, so the target's
lm_head and softcap are not used for them.

Head dtype: `head_dtype="auto"` (the default) runs the head in the dtype `python -m specdec.tune`
stored for this machine x target x kernel x head geometry (`measure_head_dtypes` times both), else
in the target's dtype; a depth reads its weights from memory after every target forward, so
halving their bytes can pay, but not on every CPU.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import torch

from specdec import machine
from specdec.target import kernels
from specdec.target.cache import KVCache
from specdec.core.draft import Draft, DraftRequest, Step
from specdec.drafters.registry import register
from specdec.drafters.eagle_head import EagleHead, HeadConfig
from specdec.drafters.speculators_format import Eagle3Head, is_speculators_dir, load_speculators
from specdec.drafters.common import BlockSlots
from specdec.target.loading import parse_dtype
from specdec.target.model import Target, tree_attention
from specdec.core.shapes import SubVocab, grow_tree

HEADS_DIR = Path(__file__).parent / "heads"
"""Shipped heads: `<target name>.safetensors` + `<target name>.json`."""


class EagleDrafter:
    """Drafts with an EAGLE head over `target`'s features (see the module docstring)."""

    def __init__(self, head: EagleHead | Eagle3Head, *, target: Target, draft_vocab: int | None = None,
                 refresh: bool = True, head_dtype: torch.dtype | None = None, name: str = "eagle") -> None:
        head.config.check_target(target)
        self.name = name
        self.refresh = refresh
        # A copy, cast and given the target's linear kernel: the caller's head may still be trained, or
        # be built into drafters of other dtypes (`measure_head_dtypes`), and must not change under them.
        # A dtype the kernel does not pack on this CPU (bf16 under oneDNN without AVX-512) stays on F.linear.
        self.head = copy.deepcopy(head).to(device=target.device, dtype=head_dtype or target.dtype).eval()
        if target.kernel != "torch":
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
                raise ValueError(f"draft_vocab must be an integer >= 1 (or None = full vocabulary), "
                                 f"got {draft_vocab!r}")
            if draft_vocab > target.vocab_size:
                raise ValueError(f"draft vocabulary of {draft_vocab} tokens is larger than target "
                                 f"{target.name!r}'s vocabulary of {target.vocab_size}")
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
        rows = self.scorer(flat) if self.scorer is not None else (weight @ flat.T).T  # W @ x^T: see Target.logits
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
        if not step.is_prefill:
            kept = [] if self.refresh else self.block.accepted(step)
            self.cache.keep(self.consumed, kept)
            self.consumed += len(kept)
        first = int(step.positions[0, 0]) if step.positions.numel() else self.consumed
        features = step.target_hidden  # [B, K, H] at positions first, first + 1, ...
        if self.aux_layers:
            if step.target_aux is None:
                raise ValueError(f"the EAGLE head fuses target layers {list(self.aux_layers)} but the Step carries "
                                 "no target_aux: the target must capture them (Target.capture_layers)")
            features = torch.cat([features, step.target_aux], -1)  # [B, K, (1 + k) H]
        features = features.to(self.features.dtype)
        self.features = torch.cat([self.features, features[:, max(0, self.consumed - first):]], 1)


def shipped_head_path(target: Target) -> Path:
    """The shipped head for `target` (by model name: a quantized target gets its model's head, trained
    on the unquantized target's features); FileNotFoundError naming the shipped ones if none."""
    path = HEADS_DIR / f"{target.name}.safetensors"
    if not path.exists():
        shipped = sorted(p.stem for p in HEADS_DIR.glob("*.safetensors"))
        raise FileNotFoundError(
            f"no EAGLE head ships for target {target.name!r} (shipped: {', '.join(shipped) or 'none'}); "
            "train one with scripts/train_eagle.py and pass head=PATH, or head='random' for an untrained head"
        )
    return path


def random_head(target: Target, seed: int = 0) -> EagleHead:
    """An untrained head for `target` (for tests), its draft vocabulary ranked by token id."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(HeadConfig.for_target(target, draft_vocab_size=target.vocab_size),
                         draft_vocab=torch.arange(target.vocab_size))
    return head


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


def measure_head_dtypes(target: Target, head: EagleHead, draft_vocab: int | None, repeats: int = 3,
                        new_tokens: int = 12) -> dict[torch.dtype, float]:
    """Median drafting seconds per step of a greedy chain(3) generation from a random 48-token prompt,
    per head dtype (interleaved, one warm-up round): timed inside decoding, where the target's forward
    between two drafts has evicted the head's weights from the caches, as it does in use."""
    from specdec.core.loop import generate

    prompt = torch.randint(0, target.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    drafters = {dtype: EagleDrafter(head, target=target, draft_vocab=draft_vocab, head_dtype=dtype)
                for dtype in HEAD_DTYPES}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in HEAD_DTYPES}
    for rep in range(repeats + 1):
        for dtype, drafter in drafters.items():
            steps = generate(target, drafter, prompt, shape="chain(3)", max_new_tokens=new_tokens, stop_on_eos=False,
                             cache="dynamic").stats.steps[1:]  # the first step also runs the prompt through the head
            if rep and steps:
                times[dtype].append(statistics.median(s.draft_time_s for s in steps))
    return {dtype: statistics.median(ts) for dtype, ts in times.items()}


DEFAULT_DRAFT_VOCAB = 4096
"""`draft_vocab="auto"` uses this many tokens when the head ranks at least that many (else the full
vocabulary): scoring 4,096 rows instead of the whole lm_head cuts draft time several-fold for a small
loss of acceptance (`scripts/bench_eagle.py` measures both)."""


@register("eagle")
def build_eagle(*, target: Target, head: str | Path | EagleHead | Eagle3Head | None = None,
                draft_vocab: int | str | None = "auto",
                refresh: bool = True, head_dtype: str | torch.dtype | None = "auto") -> EagleDrafter:
    """EAGLE drafter. head: None = the head shipped for this target, a path to a `.safetensors`
    head (with its `.json`), a speculators EAGLE-3 checkpoint directory (config.json with
    speculators_model_type 'eagle3': specdec/drafters/speculators_format.py), 'random' = untrained, or
    an EagleHead / Eagle3Head. draft_vocab: score only the N most frequent training tokens (None = full
    vocabulary; "auto" = DEFAULT_DRAFT_VOCAB when the head ranks that many); an EAGLE-3 head always
    scores its own draft vocabulary (None, "auto" or its size). refresh: see the module docstring.
    head_dtype: the dtype the head and the lm_head rows it scores run in: "auto" (the one `python -m specdec.tune` stored for this machine,
    else the target's: `choose_head_dtype`; `drafter.head_dtype_tuned` says which), None = the target's, or a
    dtype ('bfloat16' halves the bytes a draft depth reads). Drafts only: exactness does not depend on it."""
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
    drafter = EagleDrafter(head, target=target, draft_vocab=draft_vocab, refresh=refresh, head_dtype=head_dtype)
    drafter.head_dtype_tuned = tuned
    return drafter


build_eagle.test_options = {"head": "random"}
