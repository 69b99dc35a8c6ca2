"""Training prompt sources for the EAGLE head and the n-gram disjointness check.

Owns `SOURCES` (`natural-<name>` from data/prompts/, and `templates-v1`), `Prompt`, `collect` and `shared_ngrams` /
`check_disjoint`. Never reads the evaluation suites. Knows nothing about targets, tokenizers or rollouts.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from pathlib import Path

Prompt = tuple[dict, ...]  # A chat: ({"role": "user"|"assistant", "content": str}, ...), ending with a user turn.

SOURCES: dict[str, Callable[[int, int], list[Prompt]]] = {}
"""Prompt sources by name: fn(n, seed) -> up to n distinct prompts (deterministic)."""

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "data" / "prompts"
"""Where the natural-* files live: data/prompts/ of the source checkout this package was imported from."""


def prompts_dir() -> Path:
    """PROMPTS_DIR, or FileNotFoundError saying why it is absent (an install without the repository)."""
    if not PROMPTS_DIR.is_dir():
        raise FileNotFoundError(f"the training prompts are read from {PROMPTS_DIR}, which does not exist: they ship "
                                "with the repository (data/prompts/), not inside the package; install specdec "
                                "from a source checkout (pip install -e .) to use the natural-* prompt sources")
    return PROMPTS_DIR


def user(text: str) -> Prompt:
    """A one-turn chat."""
    return ({"role": "user", "content": text},)


def prompt_text(prompt: Prompt) -> str:
    """All turns of a prompt joined by newlines (what the n-gram checks read)."""
    return "\n".join(m["content"] for m in prompt)


def load(files: list[Path]) -> list[Prompt]:
    """Every prompt of `files` (lines of {"turns": [user, assistant, user, ...]}), in order, stripped and deduplicated;
    ValueError naming file and line for a chat without an odd number of turns."""
    out, seen = [], set()
    roles = ("user", "assistant")
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            turns = json.loads(line).get("turns")
            if not isinstance(turns, list) or len(turns) % 2 != 1 or not all(isinstance(t, str) and t.strip()
                                                                              for t in turns):
                raise ValueError(f"{path}:{number}: 'turns' must be an odd number of non-empty strings "
                                 "(user first and last)")
            prompt = tuple({"role": roles[i % 2], "content": t.strip()} for i, t in enumerate(turns))
            if prompt_text(prompt) not in seen:
                seen.add(prompt_text(prompt))
                out.append(prompt)
    return out


def _natural(name: str):
    def prompts(n: int, seed: int = 0) -> list[Prompt]:
        """Up to `n` of the prompts of data/prompts/natural_<name>.jsonl, in an order shuffled under `seed`."""
        pool = load([prompts_dir() / f"natural_{name}.jsonl"])
        random.Random(f"natural-{name}-{seed}").shuffle(pool)
        return pool[:n]
    return prompts


for _path in sorted(PROMPTS_DIR.glob("natural_*.jsonl")):
    SOURCES[f"natural-{_path.stem.removeprefix('natural_')}"] = _natural(_path.stem.removeprefix("natural_"))
SOURCES["templates-v1"] = lambda n, seed=0: [user(p) for p in template_prompts(n, seed)]


def template_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct instructions filled from data/prompts/templates_v1.json's templates and topic lists,
    deterministic for a given (n, seed)."""
    lists = json.loads((prompts_dir() / "templates_v1.json").read_text())
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < n:
        topic, topic2 = rng.sample(lists["topics"], 2)
        text = rng.choice(lists["templates"]).format(
            topic=topic, topic2=topic2, person=rng.choice(lists["people"]), skill=rng.choice(lists["skills"]),
            lang=rng.choice(lists["langs"]), code=rng.choice(lists["code_tasks"]), a=rng.randint(3, 99),
            b=rng.randint(2, 12),
        )
        if text not in seen:
            seen.add(text)
            prompts.append(text)
        if len(seen) > 50 * n + 10_000:
            raise ValueError(f"cannot make {n} distinct training prompts from the templates")
    return prompts


def collect(counts: dict[str, int], seed: int = 0) -> list[Prompt]:
    """Prompts from several sources ({source name: how many}), deduplicated by text, interleaved deterministically (so
    that any prefix mixes every source). ValueError on an unknown source or when the result is empty."""
    unknown = sorted(set(counts) - set(SOURCES))
    if unknown:
        missing = "" if PROMPTS_DIR.is_dir() else f" ({PROMPTS_DIR} is absent: no natural-* sources)"
        raise ValueError(f"unknown prompt source(s) {unknown}; known: {sorted(SOURCES)}{missing}")
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
    """Texts of `prompts` that share an n-word run with any of `others`, or contain a whole `others` text of
    4..n-1 words (shorter ones are common phrases)."""
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


def check_disjoint(train: list[Prompt], validation: list[Prompt], n: int = 8, what: str = "validation split") -> None:
    """ValueError naming up to three overlapping prompts if any training prompt shares an n-word run
    with the `what` texts."""
    overlap = shared_ngrams(train, [prompt_text(p) for p in validation], n)
    if overlap:
        raise ValueError(f"{len(overlap)} training prompt(s) share a {n}-word run with the {what}, e.g. "
                         f"{[o[:80] for o in overlap[:3]]}")
