"""Draft shapes as data: `ChainShape`, `TreeShape`, `DynamicShape` (EAGLE-2), `AutoShape` and `parse_shape`
(`chain(4)`, `tree(4,2,2)`, `dynamic(top_k=8,depth=6,budget=32)`, `auto`). Knows nothing about drafts or models
(growing: `specdec.core.grow`; `auto`: `specdec.loop.policy`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChainShape:
    """A single sequence of k draft tokens (the 'sequence draft')."""

    k: int  # Number of draft tokens, >= 1.

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"chain(k) needs k >= 1, got {self.k!r}")

    @property
    def max_nodes(self) -> int:
        return self.k

    @property
    def depth(self) -> int:
        return self.k

    @property
    def widths(self) -> tuple[int, ...]:
        """Children per node at each depth."""
        return (1,) * self.k

    def __str__(self) -> str:
        return f"chain({self.k})"


@dataclass(frozen=True)
class TreeShape:
    """A static tree: every node at depth d (1-based) has widths[d-1] children."""

    widths: tuple[int, ...]  # Branching per depth, each >= 1; len(widths) is the tree depth.

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))
        if not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ValueError(f"tree(widths) needs at least one width and every width >= 1, got {self.widths}")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def max_nodes(self) -> int:
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    def __str__(self) -> str:
        return f"tree({','.join(map(str, self.widths))})"


@dataclass(frozen=True)
class DynamicShape:
    """EAGLE-2 dynamic tree: expand the top_k best nodes per depth, keep the best `budget` nodes."""

    top_k: int = 8  # Children per expanded node and nodes expanded per depth, >= 1.
    depth: int = 6  # Maximum draft depth, >= 1.
    budget: int = 32  # Nodes kept after re-ranking (the verification width), >= 1.

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"dynamic({name}=...) must be an integer >= 1, got {value!r}")

    @property
    def max_nodes(self) -> int:
        return self.budget

    @property
    def widths(self) -> tuple[int, ...]:
        """The most children a node at each depth can get (top_k per expanded node)."""
        return (self.top_k,) * self.depth

    def __str__(self) -> str:
        return f"dynamic(top_k={self.top_k},depth={self.depth},budget={self.budget})"


@dataclass(frozen=True)
class AutoShape:
    """Choose a static shape (or no draft) every step from measured costs: see `specdec.loop.policy`."""

    max_depth: int = 8  # Deepest draft considered, >= 1.
    max_width: int = 4  # Most children per node considered (1 = chains only), >= 1.
    max_nodes: int = 32  # Most draft nodes verified in one step, >= 1.
    probe: int = 4
    """After this many steps without a draft, draft chain(1) once to refresh the estimates; the
    interval doubles (up to 64) after each probe that leaves "no draft" the best (resets when drafting wins). >= 1."""
    trim: int = 1
    """1: when the drafter scores its nodes (`Draft.scores`), verify only the subtree with the best
    expected tokens per second under calibrated confidences (`specdec.loop.policy`); 0: verify every node."""
    explore: int = 1
    """Optimism of the shape choice, in posterior standard deviations of each acceptance estimate
    (`specdec.loop.policy`); 0: choose on the plain estimates. >= 0."""
    latency: Any = field(default=None, compare=False)
    """A `specdec.core.curve.LatencyCurve` to use (tests, offline curves); None = the curve tuned for
    this machine, else the untuned default (`specdec.loop.tuned.tuned_latency`). Not settable from a string."""

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_width", "max_nodes", "probe"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"auto({name}=...) must be an integer >= 1, got {value!r}")
        if self.trim not in (0, 1) or isinstance(self.trim, bool):
            raise ValueError(f"auto(trim=...) must be 0 or 1, got {self.trim!r}")
        if not isinstance(self.explore, int) or isinstance(self.explore, bool) or self.explore < 0:
            raise ValueError(f"auto(explore=...) must be an integer >= 0, got {self.explore!r}")

    def __str__(self) -> str:
        trim = "" if self.trim else ",trim=0"
        explore = "" if self.explore == 1 else f",explore={self.explore}"
        return f"auto(max_depth={self.max_depth},max_width={self.max_width},max_nodes={self.max_nodes}{trim}{explore})"


Shape = ChainShape | TreeShape | DynamicShape  # A concrete draft shape: what a drafter is asked to grow.
ShapeSpec = Shape | AutoShape
"""What `generate` accepts: a concrete shape, or `auto` (a concrete shape chosen per step)."""
SHAPES: dict[str, type] = {"chain": ChainShape, "tree": TreeShape, "dynamic": DynamicShape, "auto": AutoShape}
_KEYWORD_ONLY = {"auto": ("max_depth", "max_width", "max_nodes", "probe", "trim", "explore")}


def parse_shape(spec: str | ShapeSpec) -> ShapeSpec:
    """`chain(4)` | `tree(4,2,2)` | `dynamic(top_k=8,depth=6,budget=32)` | `auto` |
    `auto(max_depth=D,max_width=W,max_nodes=N,probe=P,trim=T,explore=E)` (or a config) -> config."""
    if isinstance(spec, (ChainShape, TreeShape, DynamicShape, AutoShape)):
        return spec
    if isinstance(spec, str) and spec.strip() == "auto":
        return AutoShape()
    m = re.fullmatch(r"\s*(\w+)\s*\((.*)\)\s*", str(spec))
    if not m or m.group(1) not in SHAPES:
        raise ValueError(
            f"cannot parse draft shape {spec!r}; expected one of chain(k), tree(w1,w2,...), "
            "dynamic(top_k=K,depth=D,budget=N), auto or auto(max_depth=D,max_width=W,max_nodes=N,probe=P,trim=T,explore=E)"
        )
    kind, body = m.group(1), m.group(2)
    args, kwargs = [], {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        try:
            number = int(value if eq else key)
        except ValueError:
            raise ValueError(f"draft shape {spec!r}: {part!r} is not an integer") from None
        if eq:
            kwargs[key.strip()] = number
        else:
            args.append(number)
    if kind in _KEYWORD_ONLY:
        unknown = sorted(set(kwargs) - set(_KEYWORD_ONLY[kind]))
        if args or unknown:
            given = ", ".join(unknown) if unknown else f"positional {args}"
            raise ValueError(f"draft shape {spec!r}: {kind}(...) takes only keyword options "
                             f"{', '.join(_KEYWORD_ONLY[kind])}; unknown: {given}")
    if kind == "tree":
        if kwargs:
            raise ValueError(f"tree(...) takes positional widths only, got {spec!r}")
        return TreeShape(tuple(args))
    try:
        return SHAPES[kind](*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"draft shape {spec!r}: {err}") from None
