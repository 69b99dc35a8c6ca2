"""Per-step draft shape policies: `ShapePolicy`, `FixedShape` (one shape, or none), `ProposeOnly` (verify nothing) and
`shape_policy` (`auto` -> `AutoPolicy`, kept with the drafter across generations). A policy only names a shape, so
every policy is exact by construction. Knows nothing about how drafts are grown or verified.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from specdec.core.draft import Draft
from specdec.core.events import StepEvent
from specdec.core.shapes import AutoShape, Shape, ShapeSpec
from specdec.loop.auto_policy import AutoPolicy

if TYPE_CHECKING:
    from specdec.runtime.model import Target


@runtime_checkable
class ShapePolicy(Protocol):
    """Picks the shape each step drafts; the loop calls `choose` before a step, `keep` on each row's
    proposal, and `observe` with the step's event for each of its rows."""

    max_nodes: int  # The most draft nodes a step may verify (sizes the loop's cache).

    def choose(self, context: int) -> Shape | None:
        """The concrete shape to draft next (None = draft nothing), `context` tokens committed."""

    def keep(self, draft: Draft, context: int) -> torch.Tensor | None:
        """The node indices of the proposed draft to verify (ascending, ancestor-closed; None = all)."""

    def observe(self, event: StepEvent, row: int) -> None:
        """Take in batch row `row` of one verified step."""


class FixedShape:
    """The same concrete shape every step."""

    def __init__(self, shape: Shape | None, target: Target | None = None) -> None:
        self.shape = shape  # None: never draft (plain decoding)
        self.max_nodes = 0 if shape is None else shape.max_nodes

    def choose(self, context: int) -> Shape | None:
        return self.shape

    def keep(self, draft: Draft, context: int) -> torch.Tensor | None:
        return None

    def observe(self, event: StepEvent, row: int) -> None:
        pass


class ProposeOnly:
    """Asks for `shape` every step and verifies none of it, so each step commits one token: how a tool records
    a drafter's proposal at every position of a path."""

    max_nodes = 0

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def choose(self, context: int) -> Shape:
        return self.shape

    def keep(self, draft: Draft, context: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)

    def observe(self, event: StepEvent, row: int) -> None:
        pass


_POLICIES = {AutoShape: AutoPolicy}
"""Shape configs that are policies rather than concrete shapes; any other shape is `FixedShape`."""
_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""drafter -> {(config, target id): its AutoPolicy}: estimates carried across generations."""


def shape_policy(spec: ShapeSpec, target: Target | None = None, drafter: object | None = None,
                 cache: str = "dynamic", batch: int = 1) -> ShapePolicy:
    """The policy for a parsed shape: `FixedShape` for a concrete one, else its registered policy, reused across
    generations of the same `drafter`; `cache` and `batch` say which latency curve it plans with."""
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
