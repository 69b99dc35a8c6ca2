"""The drafter contract and the data that flows between the loop, the drafters and the verifier.

Owns the `Drafter` protocol (`reset`, `propose`, `commit`), `DraftRequest` (what the loop asks before each step),
`Draft` (the one shape every drafter returns, with `node_ids` that survive pruning), `Acceptance` (the verifier's
decision for one sequence) and `Step` (what `drafter.commit` hears after the prefill and each verification: committed
tokens, accepted nodes, the target's hidden states and a read-only view of its KV for those positions).
Knows nothing about models, caches, acceptance rules or any particular drafter; imports only `tree`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from specdec.core import tree as tree_ops

from specdec.core.shapes import Shape

if TYPE_CHECKING:
    from specdec.core.sampling import SamplingConfig

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) per decoder layer, each [B, kv_heads, S, head_dim].


@dataclass(frozen=True)
class Draft:
    """A draft tree: node i proposes `tokens[0, i]` after its parent (after the root, the last committed token,
    when `parents[i] == -1`); parents precede children. A chain has parents [-1, 0, 1, ...]."""

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [N] long, -1 = child of the root
    draft_probs: torch.Tensor | None = None
    """[B, N, V]: the distribution node i was drawn from (given its parent and, for siblings, given
    the earlier siblings). None = point-mass draft: every node is a deterministic proposal."""
    node_ids: torch.Tensor | None = None
    """[N] long: the drafter's own id of each node (e.g. its index in growth order), kept by
    `subtree`, so the drafter maps accepted nodes back to its state by a gather. None = 0..N-1."""
    scores: torch.Tensor | None = None
    """[N] float, optional: the drafter's cumulative log-probability of each node's path (what a
    dynamic tree ranks by), for tools that re-rank a recorded draft. None = not recorded."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tree_ops.as_parents(self.parents))
        n = self.parents.numel()
        if self.tokens.dim() != 2 or self.tokens.shape[1] != n:
            raise ValueError(
                f"Draft.tokens must be [B, N] with N = len(parents) = {n}, got shape {tuple(self.tokens.shape)}"
            )
        if self.draft_probs is not None and self.draft_probs.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"Draft.draft_probs must be [B, N, V] matching tokens {tuple(self.tokens.shape)}, "
                f"got {tuple(self.draft_probs.shape)}"
            )
        ids = torch.arange(n) if self.node_ids is None else torch.as_tensor(self.node_ids, dtype=torch.long).cpu()
        if ids.shape != (n,):
            raise ValueError(f"Draft.node_ids must be [N] with N = {n}, got shape {tuple(ids.shape)}")
        object.__setattr__(self, "node_ids", ids)
        if self.scores is not None and tuple(self.scores.shape) != (n,):
            raise ValueError(f"Draft.scores must be [N] with N = {n}, got shape {tuple(self.scores.shape)}")

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    @property
    def depth(self) -> int:
        """Depth of the deepest node (0 for an empty draft)."""
        return int(tree_ops.depths(self.parents).max()) if self.num_nodes else 0

    @staticmethod
    def empty(batch: int = 1, device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(batch, 0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long))

    def subtree(self, keep: torch.Tensor) -> Draft:
        """The draft restricted to nodes `keep` (ascending, ancestor-closed); node ids are kept."""
        keep = torch.as_tensor(keep, dtype=torch.long).cpu()
        probs = None if self.draft_probs is None else self.draft_probs[:, keep.to(self.draft_probs.device)]
        scores = None if self.scores is None else self.scores[keep.to(self.scores.device)]
        return Draft(self.tokens[:, keep.to(self.tokens.device)], tree_ops.reindex(self.parents, keep), probs,
                     self.node_ids[keep], scores)


@dataclass(frozen=True)
class Acceptance:
    """The verifier's decision for one sequence and one step."""

    path: list[int]  # Draft node indices accepted, root's child first (length = accepted tokens this step).
    next_token: int
    """The token sampled by the target after the accepted path: the *bonus* token when the whole
    path to a leaf was accepted, else the *recovered* token drawn from the residual."""
    bonus: bool  # True when next_token is a bonus token (the last accepted node had no children left to try).

    @property
    def num_accepted(self) -> int:
        return len(self.path)


@dataclass
class Step:
    """What the loop tells a drafter after the target committed tokens (`Drafter.commit`).

    Sent once after the prefill (`acceptances` empty) and after every verification. The *kept rows*
    (made permanent): after the prefill every prompt token but the root, after a step the root and the
    accepted nodes: the committed tokens `token_ids[:, L - num_new - 1 : L - 1]`, at `positions`."""

    token_ids: torch.Tensor  # [B, L] every committed token, the last one is the next root (left-padded: `lengths`)
    num_new: list[int]
    """Per sequence: tokens committed by this step (accepted + next token; after the prefill: the whole prompt)."""
    draft: Draft
    acceptances: list[Acceptance]  # One per sequence; empty after the prefill.
    positions: torch.Tensor  # [B, K] absolute positions of the kept rows
    target_hidden: torch.Tensor  # [B, K, H] the target's final hidden state (lm_head input) per kept row
    target_aux: torch.Tensor | None = None  # [B, K, kH] hidden states of `Target.aux_layers` per kept row
    _kv: Callable[[], KVLayers] = field(repr=False, default=list)
    drafts: list[Draft] | None = None
    """Batches: each row's own draft (rows draft different trees); None = every row's is `draft`."""
    lengths: list[int] | None = None
    """Batches: committed tokens per row; row b is `token_ids[b, L - lengths[b]:]` (left padding).
    None = every row has L."""
    kept: list[int] | None = None
    """Batches: kept rows per row; row b's are the first kept[b] of the K columns of `positions`,
    `target_hidden` and `target_kv()` (the rest is padding). None = all K."""

    @property
    def is_prefill(self) -> bool:
        return not self.acceptances

    @property
    def batch(self) -> int:
        return self.token_ids.shape[0]

    def draft_of(self, row: int) -> Draft:
        """Row `row`'s draft."""
        return self.draft if self.drafts is None else self.drafts[row]

    def row(self, b: int) -> Step:
        """Row b of a batched step as a batch-of-one step (views, no copies): what a drafter that
        drafts each row on its own (`specdec.drafters.common.PerRow`) hands each row's state."""
        length = self.token_ids.shape[1] if self.lengths is None else self.lengths[b]
        kept = self.positions.shape[1] if self.kept is None else self.kept[b]
        kv = self._kv
        return Step(
            token_ids=self.token_ids[b:b + 1, self.token_ids.shape[1] - length:], num_new=[self.num_new[b]],
            draft=self.draft_of(b), acceptances=self.acceptances[b:b + 1], positions=self.positions[b:b + 1, :kept],
            target_hidden=self.target_hidden[b:b + 1, :kept],
            target_aux=None if self.target_aux is None else self.target_aux[b:b + 1, :kept],
            _kv=lambda: [(k[b:b + 1, :, :kept], v[b:b + 1, :, :kept]) for k, v in kv()],
        )

    @property
    def acceptance(self) -> Acceptance:
        """The one sequence's acceptance (B = 1; raises after the prefill or for B > 1)."""
        if len(self.acceptances) != 1:
            raise ValueError(f"Step.acceptance needs exactly one sequence, this step has {len(self.acceptances)}")
        return self.acceptances[0]

    def accepted_node_ids(self, row: int = 0) -> torch.Tensor:
        """[A] the drafter's node ids (`Draft.node_ids`) of sequence `row`'s accepted path."""
        if self.is_prefill:
            return torch.empty(0, dtype=torch.long)
        return self.draft_of(row).node_ids[torch.tensor(self.acceptances[row].path, dtype=torch.long)]

    def target_kv(self) -> KVLayers:
        """Read-only (keys, values) per target layer for the kept rows, [B, kv_heads, K, head_dim]: views into the
        target's cache, valid until the next step (copy what you keep), built on demand."""
        return self._kv()


@dataclass
class DraftRequest:
    """What the loop gives a drafter before each step (one row per sequence of the batch)."""

    token_ids: torch.Tensor  # [B, L] every committed token: prompt + generated; the last is the root
    shape: Shape
    sampling: SamplingConfig
    generator: torch.Generator  # The random stream of row 0 (of the only row at B = 1).
    max_depth: int  # Nodes deeper than this are useless (generation ends first); drafters may stop early.
    lengths: list[int] | None = None
    """Batches: committed tokens per row, left-padded in `token_ids` (None = every row has L)."""
    generators: list[torch.Generator] | None = None
    """Batches: each row's random stream (row b draws only from generators[b]); None = [generator]."""
    max_depths: list[int] | None = None
    """Batches: each row's own `max_depth` (rows have different numbers of tokens left); `max_depth` is
    their largest. A row drafting past its own would draw randomness its run alone never draws."""

    @property
    def batch(self) -> int:
        return self.token_ids.shape[0]

    def row(self, b: int) -> DraftRequest:
        """Row b as a batch-of-one request (its tokens without padding, its own random stream)."""
        length = self.token_ids.shape[1] if self.lengths is None else self.lengths[b]
        generator = self.generator if self.generators is None else self.generators[b]
        depth = self.max_depth if self.max_depths is None else self.max_depths[b]
        return DraftRequest(self.token_ids[b:b + 1, self.token_ids.shape[1] - length:], self.shape, self.sampling,
                            generator, depth)


@runtime_checkable
class Drafter(Protocol):
    """A proposer of draft trees; one instance serves one generation at a time. Per generation: `reset()`,
    `commit(prefill step)`, then per step `propose(request)` -> (the loop verifies) -> `commit(step)`."""

    name: str

    def reset(self) -> None:
        """Forget all per-sequence state; called before every generation."""

    def propose(self, request: DraftRequest) -> Draft:
        """Return a draft for the continuation of `request.token_ids`, in `request.shape`."""

    def commit(self, step: Step) -> None:
        """Take in what the target committed (`Step`): roll back rejected nodes' state, keep the accepted ones
        (`step.accepted_node_ids()`), and read the target's features or KV if the drafter uses them."""


@runtime_checkable
class BatchDrafter(Drafter, Protocol):
    """A drafter that serves a batch (`specdec.generate_batch` with more than one prompt): it sets `batchable = True`,
    drafts every row in `propose_batch` (one `Draft` per row, each [1, N_b]; rows may differ in size and shape) and
    drops finished rows in `select_rows`. Its `commit` takes B-row steps (`Step.row(b)`, `Step.kept`, `Step.lengths`). A
    row draws randomness only from its own `request.generators[b]`, so its draft never depends on its neighbours."""

    batchable: bool

    def propose_batch(self, request: DraftRequest) -> list[Draft]:
        """One draft per row of `request` (in `request.shape`, at most `request.max_depth` deep)."""

    def select_rows(self, rows: list[int]) -> None:
        """Keep only the rows `rows` (ascending indices into the current batch)."""
