"""Per-step draft shape policies: what the loop asks before a step, and which policy a shape means.

Owns `ShapePolicy` (what the loop asks before a step and tells after it), `FixedShape` (the same
concrete shape every step, or none: plain decoding) and the registry `shape_policy` that maps a
shape config to its policy (`auto` -> `specdec.loop.auto_policy.AutoPolicy`), keeping a learning
policy's estimates with the drafter object across generations. Knows nothing about how drafts are
grown or verified: a policy only names a concrete shape (or none); the drafter grows it and the
verifier checks it, so every policy is exact by construction.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from specdec.loop.auto_policy import AutoPolicy
from specdec.core.draft import Acceptance, Draft
from specdec.core.shapes import AutoShape, Shape, ShapeSpec

if TYPE_CHECKING:
    from specdec.core.metrics import StepRecord
    from specdec.runtime.model import Target


@runtime_checkable
class ShapePolicy(Protocol):
    """Picks the shape each step drafts; the loop calls `choose` before a step, `trim` on the
    drafter's proposal, and `observe` after the verification."""

    max_nodes: int
    """The most draft nodes a step may verify (sizes the loop's cache)."""

    def choose(self, context: int) -> Shape | None:
        """The concrete shape to draft next (None = draft nothing), `context` tokens committed."""

    def trim(self, draft: Draft, context: int) -> Draft:
        """The part of the proposed draft to verify (ancestor-closed; the draft itself = all of it)."""

    def observe(self, draft: Draft, acceptance: Acceptance, record: StepRecord, context: int) -> None:
        """Take in one verified step (its draft, the verifier's decision and its timings)."""


class FixedShape:
    """The same concrete shape every step."""

    def __init__(self, shape: Shape | None, target: Target | None = None) -> None:
        self.shape = shape  # None: never draft (plain decoding)
        self.max_nodes = 0 if shape is None else shape.max_nodes

    def choose(self, context: int) -> Shape | None:
        return self.shape

    def trim(self, draft: Draft, context: int) -> Draft:
        return draft

    def observe(self, draft: Draft, acceptance: Acceptance, record: StepRecord, context: int) -> None:
        pass


_POLICIES = {AutoShape: AutoPolicy}
"""Shape configs that are policies rather than concrete shapes; any other shape is `FixedShape`."""
_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""drafter -> {(config, target id): its AutoPolicy}: estimates carried across generations."""


def shape_policy(spec: ShapeSpec, target: Target | None = None, drafter: object | None = None,
                 cache: str = "dynamic", batch: int = 1) -> ShapePolicy:
    """The policy for a parsed shape config: `FixedShape` for a concrete shape, else its registered
    one, reused from earlier generations of the same `drafter` (see the module docstring). `cache`
    is the loop's cache kind (`specdec.runtime.forwards.CACHES`): whose forwards a latency curve must time;
    `batch` the rows each verification forwards (a batch plans with the curve at its batch size)."""
    factory = _POLICIES.get(type(spec))
    if factory is None:
        return FixedShape(spec, target)
    try:
        learned = _LEARNED.setdefault(drafter, {})
    except TypeError:  # None, or a drafter that cannot be weakly referenced or hashed: no memory
        return factory(spec, target, cache, batch)
    key = (spec, id(spec.latency), id(target), cache, batch)
    if key not in learned:
        learned[key] = factory(spec, target, cache, batch)
    learned[key].start()
    return learned[key]
