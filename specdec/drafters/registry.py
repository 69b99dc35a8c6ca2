"""The drafter registry: drafters by name, and how a drafter is spelled on a command line.

Owns `register`, `build`, `names`, `build_for_tests` and `parse_specs` (`eagle[head_dtype=bfloat16]`); the contract
lives in `specdec.core.draft`. Knows nothing about verification or the target's cache.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specdec.core.draft import Drafter

if TYPE_CHECKING:
    from specdec.runtime.model import Target


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
