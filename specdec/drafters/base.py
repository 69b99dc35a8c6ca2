"""The drafter contract: what a drafter is given, what it returns, and the name registry.

Owns: `Draft` (the one draft shape every drafter returns), `DraftRequest` (what the loop tells a
drafter before each step), `Acceptance` (what the loop tells it after verification), the `Drafter`
protocol and the registry (`register`, `build`, `names`). Knows nothing about how drafts are
verified or how the target's cache works; each drafter owns its own state and rolls it back itself
when the loop calls `rollback`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from specdec import tree as tree_ops

if TYPE_CHECKING:
    from specdec.models import Target
    from specdec.sampling import SamplingConfig
    from specdec.shapes import Shape


@dataclass(frozen=True)
class Draft:
    """A draft tree. A chain is the tree with parents [-1, 0, 1, ...].

    Node i proposes token `tokens[0, i]` as a continuation of its parent (or of the root, the last
    committed token, when `parents[i] == -1`). Parents precede children.
    """

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [N] long, -1 = child of the root
    draft_probs: torch.Tensor | None = None
    """[B, N, V]: the distribution node i was drawn from (given its parent and, for siblings, given
    the earlier siblings). None = point-mass draft: every node is a deterministic proposal."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tree_ops.as_parents(self.parents))
        if self.tokens.dim() != 2 or self.tokens.shape[1] != self.parents.numel():
            raise ValueError(
                f"Draft.tokens must be [B, N] with N = len(parents) = {self.parents.numel()}, "
                f"got shape {tuple(self.tokens.shape)}"
            )
        if self.draft_probs is not None and self.draft_probs.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"Draft.draft_probs must be [B, N, V] matching tokens {tuple(self.tokens.shape)}, "
                f"got {tuple(self.draft_probs.shape)}"
            )

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    @staticmethod
    def empty(batch: int = 1, device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(batch, 0, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long))

    def subtree(self, keep: torch.Tensor) -> Draft:
        """The draft restricted to nodes `keep` (ascending, ancestor-closed)."""
        probs = None if self.draft_probs is None else self.draft_probs[:, keep.to(self.draft_probs.device)]
        return Draft(self.tokens[:, keep.to(self.tokens.device)], tree_ops.reindex(self.parents, keep), probs)


@dataclass
class DraftRequest:
    """What the loop gives a drafter before each step (B = 1 rows in every tensor)."""

    token_ids: torch.Tensor  # [B, L] every committed token: prompt + generated; the last is the root
    num_new: int
    """How many of the trailing `token_ids` were committed since the previous `propose` (for the
    first call: the whole prompt)."""
    target_hidden: torch.Tensor | None  # [B, L-1, H] target last-layer hidden state per position
    """The target's final hidden state (input of its lm_head) at every committed position except the
    root, which the target has not processed yet. Filled only for drafters with `needs_target_hidden`."""
    shape: Shape
    sampling: SamplingConfig
    generator: torch.Generator
    max_depth: int
    """Nodes deeper than this are useless (generation ends first); drafters may stop early."""


@dataclass
class Acceptance:
    """The verifier's decision for one step."""

    path: list[int]
    """Draft node indices accepted, root's child first (length = accepted tokens this step)."""
    next_token: int
    """The token sampled by the target after the accepted path: the *bonus* token when the whole
    path to a leaf was accepted, else the *recovered* token drawn from the residual."""
    bonus: bool
    """True when next_token is a bonus token (the last accepted node had no children left to try)."""

    @property
    def num_accepted(self) -> int:
        return len(self.path)


@runtime_checkable
class Drafter(Protocol):
    """A proposer of draft trees. One instance serves one generation at a time."""

    name: str
    needs_target_hidden: bool

    def reset(self) -> None:
        """Forget all per-sequence state; called before every generation."""

    def propose(self, request: DraftRequest) -> Draft:
        """Return a draft for the continuation of `request.token_ids`, in `request.shape`."""

    def rollback(self, draft: Draft, acceptance: Acceptance) -> None:
        """Drop the state of rejected draft nodes. `acceptance.next_token` is not yet committed
        into the drafter's state: it arrives as part of the next request's new tokens."""


Factory = Callable[..., Drafter]
_REGISTRY: dict[str, Factory] = {}


def register(name: str) -> Callable[[Factory], Factory]:
    """Class/function decorator: make a drafter buildable as `specdec.drafters.build(name, ...)`."""

    def wrap(factory: Factory) -> Factory:
        if name in _REGISTRY:
            raise ValueError(f"drafter {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def names() -> list[str]:
    """Every registered drafter name, sorted."""
    return sorted(_REGISTRY)


def build(name: str, *, target: Target, **options: Any) -> Drafter:
    """Build the drafter registered as `name` for `target`; `options` go to its factory."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown drafter {name!r}; registered drafters: {', '.join(names())}")
    return _REGISTRY[name](target=target, **options)



def build_for_tests(name: str, *, target: Target) -> Drafter:
    """Build `name` for a tiny test target, with the options its factory declares in an optional
    `test_options` attribute (e.g. a randomly initialised head where no trained one exists)."""
    factory = _REGISTRY[name]
    return factory(target=target, **getattr(factory, "test_options", {}))
