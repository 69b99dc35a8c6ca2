"""Training prompt sources for the EAGLE head, the train/validation split and the disjointness check.

Owns the prompt-source registry (`SOURCES`: name -> function(n, seed) -> prompts), `Prompt` (a chat
as a tuple of {"role", "content"} messages, the last one a user turn), `collect` (prompts from
several sources, deduplicated, in a fixed order), `split` (train / validation, checked disjoint) and
`shared_ngrams` (the n-gram overlap test used against the evaluation suites and between splits).
Knows nothing about targets, tokenizers or rollouts: `self_instruct` (prompts the target writes) is a
separate function in specdec/training/eagle.py because it needs the target.

Sources (each module docstring says where its text comes from):
- `chat`: written for this project: topics x task types (questions, instructions, coding, math,
  rewriting, extraction, multi-turn) x styles and lengths, filled under a seed (chat.py).
- `stdlib`: passages from the docstrings of Python's standard library (PSF licence; ships with the
  interpreter) wrapped in rewriting / extraction / summarising / explaining tasks (stdlib.py).
- `natural-<name>`: chat prompts written for this project one by one, as people type them, one
  source per file natural_<name>.jsonl (natural.py).
- `templates-v1`: the templates the first shipped head was trained on (kept for reproducibility).

The evaluation suites (experiments/prompts/*.jsonl) are never read here; tests/test_eagle_training.py
checks every source against all of them, and scripts/train_eagle.py re-checks the prompts it uses.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable

Prompt = tuple[dict, ...]
"""A chat: ({"role": "user"|"assistant", "content": str}, ...), ending with a user turn."""

SOURCES: dict[str, Callable[[int, int], list[Prompt]]] = {}
"""Prompt sources by name: fn(n, seed) -> up to n distinct prompts (deterministic)."""


def register(name: str):
    def wrap(fn):
        if name in SOURCES:
            raise ValueError(f"prompt source {name!r} is registered twice")
        SOURCES[name] = fn
        return fn
    return wrap


def user(text: str) -> Prompt:
    """A one-turn chat."""
    return ({"role": "user", "content": text},)


def prompt_text(prompt: Prompt) -> str:
    """All turns of a prompt joined by newlines (what the n-gram checks read)."""
    return "\n".join(m["content"] for m in prompt)


def collect(counts: dict[str, int], seed: int = 0) -> list[Prompt]:
    """Prompts from several sources ({source name: how many}), deduplicated by text, interleaved
    deterministically (so that any prefix mixes every source). ValueError on an unknown source or
    when the result is empty."""
    unknown = sorted(set(counts) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown prompt source(s) {unknown}; known: {sorted(SOURCES)}")
    made = {name: SOURCES[name](n, seed) for name, n in counts.items() if n > 0}
    empty = [name for name, got in made.items() if not got]
    if empty:
        raise ValueError(f"prompt source(s) {empty} gave no prompts")
    parts = list(made.values())
    mixed, seen = [], set()
    rng = random.Random(seed)
    cursors = [0] * len(parts)
    while any(c < len(p) for c, p in zip(cursors, parts)):
        alive = [i for i, p in enumerate(parts) if cursors[i] < len(p)]
        # pick a source with probability proportional to what it still has
        i = rng.choices(alive, weights=[len(parts[j]) - cursors[j] for j in alive])[0]
        p = parts[i][cursors[i]]
        cursors[i] += 1
        if prompt_text(p) not in seen:
            seen.add(prompt_text(p))
            mixed.append(p)
    if not mixed:
        raise ValueError(f"no training prompts: every source in {counts} is empty or has a count of 0")
    return mixed


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Runs of n consecutive words (lowercased, punctuation stripped)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def shared_ngrams(prompts: Iterable[Prompt], others: Iterable[str], n: int = 8) -> list[str]:
    """Texts of `prompts` that share an n-word run with any of the `others` texts, or contain the
    whole of an `others` text of 4..n-1 words (so 'Why do cats purr?' is caught too; shorter texts
    such as 'Say hello.' are common phrases, not prompts a training set could leak)."""
    others = list(others)
    banned = set().union(set(), *(ngrams(t, n) for t in others))
    short: dict[int, set[tuple[str, ...]]] = {}
    for t in others:
        words = tuple(re.findall(r"[a-z0-9]+", t.lower()))
        if 4 <= len(words) < n:
            short.setdefault(len(words), set()).add(words)

    def hit(text: str) -> bool:
        return bool(ngrams(text, n) & banned) or any(ngrams(text, k) & grams for k, grams in short.items())
    return [prompt_text(p) for p in prompts if hit(prompt_text(p))]


def split(prompts: list[Prompt], num_validation: int, seed: int = 0, n: int = 8) -> tuple[list[Prompt], list[Prompt]]:
    """(train, validation): `num_validation` prompts drawn under `seed`, then every training prompt
    sharing an n-word run with a validation prompt dropped (so the two are disjoint by the same test
    as the evaluation suites). Raises ValueError if nothing is left to train on."""
    if not 0 < num_validation < len(prompts):
        raise ValueError(f"num_validation={num_validation} must lie in 1..{len(prompts) - 1} "
                         f"for {len(prompts)} prompts")
    order = random.Random(seed).sample(range(len(prompts)), num_validation)
    chosen = set(order)
    validation = [prompts[i] for i in sorted(chosen)]
    close = set(shared_ngrams([prompts[i] for i in range(len(prompts)) if i not in chosen],
                              [prompt_text(p) for p in validation], n))
    train = [p for i, p in enumerate(prompts) if i not in chosen and prompt_text(p) not in close]
    if not train:
        raise ValueError("every training prompt overlaps the validation split; give more or more varied prompts")
    check_disjoint(train, validation, n)
    return train, validation


def check_disjoint(train: list[Prompt], validation: list[Prompt], n: int = 8, what: str = "validation split") -> None:
    """ValueError naming up to three overlapping prompts if any training prompt shares an n-word run
    with the `what` texts."""
    overlap = shared_ngrams(train, [prompt_text(p) for p in validation], n)
    if overlap:
        raise ValueError(f"{len(overlap)} training prompt(s) share a {n}-word run with the {what}, e.g. "
                         f"{[o[:80] for o in overlap[:3]]}")


from specdec.training.prompts import chat, natural, stdlib, templates_v1  # noqa: E402,F401  (registers the sources)
