"""Prompt suites: questions in the Spec-Bench / MT-bench format, from a file or the `datasets` hub.

Owns `Question`, reading and checking the JSONL format, suite names, and selecting questions by category, id, count and
turns. Knows nothing about models.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from experiments.config import DatasetConfig

SUITES_DIR = Path(__file__).parent / "prompts"
HUB_PREFIX = "hf:"


class PromptSuiteError(ValueError):
    """A prompt source that cannot be read or has no usable questions."""


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]  # User messages; turn i > 0 follows the model's own answer to turn i - 1.


def suite_names() -> list[str]:
    """The suites shipped in experiments/prompts (file stems)."""
    return sorted(p.stem for p in SUITES_DIR.glob("*.jsonl"))


def resolve_source(source: str) -> Path | str:
    """A suite name -> its file; an existing path -> itself; `hf:ID` -> unchanged."""
    if source.startswith(HUB_PREFIX):
        return source
    suite = SUITES_DIR / f"{source}.jsonl"
    if "/" not in source and suite.exists():
        return suite
    path = Path(source).expanduser()
    if path.is_file():
        return path.resolve()
    raise PromptSuiteError(
        f"prompt source {source!r} is neither a suite in {SUITES_DIR} ({', '.join(suite_names())}), "
        f"nor an existing file, nor a hub dataset written as '{HUB_PREFIX}HUB_ID[:SPLIT]'"
    )


def _question(record: object, where: str) -> Question:
    """Validate one record of the question format; `where` names it in errors (file:line)."""
    if not isinstance(record, dict):
        raise PromptSuiteError(f"{where}: expected a JSON object with question_id, category, turns; "
                               f"got {type(record).__name__}")
    missing = [k for k in ("question_id", "category", "turns") if k not in record]
    if missing:
        raise PromptSuiteError(f"{where}: missing key(s) {missing}; a question needs question_id, category and turns")
    turns = record["turns"]
    if isinstance(turns, str) or not isinstance(turns, (list, tuple)) or not turns \
            or not all(isinstance(t, str) and t.strip() for t in turns):
        raise PromptSuiteError(f"{where}: 'turns' must be a non-empty list of non-empty strings, got {turns!r:.80}")
    if not isinstance(record["category"], str) or not record["category"]:
        raise PromptSuiteError(f"{where}: 'category' must be a non-empty string, got {record['category']!r}")
    return Question(str(record["question_id"]), record["category"], tuple(turns))


def read_jsonl(path: Path) -> list[Question]:
    """Every question in a JSONL file (blank lines skipped). Errors name the file and line."""
    questions: list[Question] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptSuiteError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from err
            questions.append(_question(record, f"{path}:{number}"))
    if not questions:
        raise PromptSuiteError(f"{path}: the prompt file has no questions (it is empty or blank)")
    return questions


def read_hub(source: str) -> list[Question]:
    """Questions from a `datasets` hub dataset `hf:ID[:SPLIT]` (default split `train`) with the
    question_id / category / turns columns."""
    spec = source[len(HUB_PREFIX):]
    hub_id, _, split = spec.partition(":")
    try:
        import datasets
    except ModuleNotFoundError as err:
        raise PromptSuiteError(
            f"prompt source {source!r} needs the `datasets` package (pip install 'specdec[experiments]'); "
            "or download the questions as JSONL and pass the file"
        ) from err
    try:
        rows = datasets.load_dataset(hub_id, split=split or "train")
    except (OSError, ConnectionError, ValueError, FileNotFoundError) as err:
        raise PromptSuiteError(
            f"could not load hub dataset {hub_id!r} (split {split or 'train'!r}): {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}. If the hub is unreachable, download the "
            "questions where it is reachable, save them as JSONL (question_id, category, turns) and pass the file"
        ) from err
    questions = [_question(dict(row), f"{source} row {i}") for i, row in enumerate(rows)]
    if not questions:
        raise PromptSuiteError(f"{source}: the hub dataset has no rows")
    return questions


def load_questions(dataset: DatasetConfig) -> list[Question]:
    """The questions `dataset` selects, in source order. A selection that keeps nothing is an error."""
    source = resolve_source(dataset.source)
    questions = read_hub(source) if isinstance(source, str) else read_jsonl(source)
    if dataset.categories:
        unknown = sorted(set(dataset.categories) - {q.category for q in questions})
        if unknown:
            raise PromptSuiteError(f"{dataset.source}: no questions in categories {unknown}; it has "
                                   f"{sorted({q.category for q in questions})}")
        questions = [q for q in questions if q.category in dataset.categories]
    if dataset.question_ids:
        wanted = [str(i) for i in dataset.question_ids]
        unknown = sorted(set(wanted) - {q.question_id for q in questions})
        if unknown:
            raise PromptSuiteError(f"{dataset.source}: question ids {unknown} not found (after the category filter)")
        questions = [q for q in questions if q.question_id in wanted]
    if dataset.per_category is not None:
        if dataset.per_category < 1:
            raise PromptSuiteError(f"dataset.per_category must be >= 1 or null, got {dataset.per_category}")
        seen: dict[str, int] = {}
        kept = []
        for q in questions:
            seen[q.category] = seen.get(q.category, 0) + 1
            if seen[q.category] <= dataset.per_category:
                kept.append(q)
        questions = kept
    if dataset.max_turns is not None:
        if dataset.max_turns < 1:
            raise PromptSuiteError(f"dataset.max_turns must be >= 1 or null, got {dataset.max_turns}")
        questions = [Question(q.question_id, q.category, q.turns[: dataset.max_turns]) for q in questions]
    return questions


def digest(questions: Iterable[Question]) -> str:
    """A content hash of the selected questions (part of a cell's identity)."""
    text = json.dumps([[q.question_id, q.category, list(q.turns)] for q in questions], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
