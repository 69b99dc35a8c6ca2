"""The drafter contract: what a drafter is asked, and the name registry.

Owns: `DraftRequest` (what the loop asks a drafter before each step), the `Drafter` protocol
(`reset`, `propose`, `commit`), the registry (`register`, `build`, `names`) and how a drafter is
spelled with its options on a command line (`parse_specs`: `eagle[head_dtype=bfloat16]`). The records a
drafter returns and receives (`Draft`, `Step`) live in `specdec.draft`. Knows nothing about how
drafts are verified or how the target's cache works; each drafter owns its own state and updates
it, rollback included, in `commit`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from specdec.draft import Draft, Step

if TYPE_CHECKING:
    from specdec.models import Target
    from specdec.sampling import SamplingConfig
    from specdec.shapes import Shape


@dataclass
class DraftRequest:
    """What the loop gives a drafter before each step (B = 1 rows in every tensor)."""

    token_ids: torch.Tensor  # [B, L] every committed token: prompt + generated; the last is the root
    shape: Shape
    sampling: SamplingConfig
    generator: torch.Generator
    max_depth: int
    """Nodes deeper than this are useless (generation ends first); drafters may stop early."""


@runtime_checkable
class Drafter(Protocol):
    """A proposer of draft trees. One instance serves one generation at a time.

    Call order for one generation: `reset()`, `commit(prefill step)`, then per step
    `propose(request)` -> (the loop verifies) -> `commit(step)`.
    """

    name: str

    def reset(self) -> None:
        """Forget all per-sequence state; called before every generation."""

    def propose(self, request: DraftRequest) -> Draft:
        """Return a draft for the continuation of `request.token_ids`, in `request.shape`."""

    def commit(self, step: Step) -> None:
        """Take in what the target committed (`specdec.draft.Step`): drop the state of rejected
        draft nodes (rollback), keep the accepted ones (`step.accepted_node_ids()`), and read the
        target's features or KV for the committed positions if the drafter uses them."""


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


def parse_options(text: str) -> dict:
    """`k=v,k2=v2` -> dict; values parsed as JSON where they are (numbers, true/false), else strings."""
    options = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"drafter options are k=v pairs separated by commas, got {part!r}")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def parse_specs(text: str) -> list[tuple[str, dict]]:
    """'eagle,eagle[head_dtype=bfloat16,refresh=false],ngram' -> [(name, options), ...]: drafters
    separated by commas outside brackets, each optionally with its options in brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())  # what an unclosed bracket left
    specs = []
    for item in filter(None, items):
        match = re.fullmatch(r"([\w-]+)(?:\[(.*)\])?", item)
        if match is None:
            raise ValueError(f"a drafter is NAME or NAME[k=v,...], got {item!r}")
        specs.append((match[1], parse_options(match[2] or "")))
    return specs


def build_for_tests(name: str, *, target: Target) -> Drafter:
    """Build `name` for a tiny test target, with the options its factory declares in an optional
    `test_options` attribute (e.g. a randomly initialised head where no trained one exists)."""
    factory = _REGISTRY[name]
    return factory(target=target, **getattr(factory, "test_options", {}))
