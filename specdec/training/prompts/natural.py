"""The `natural-*` prompt sources: chat prompts written out one by one, as people type them.

The `chat` source fills templates, so its prompts share their phrasings ("Is X good or bad for the
environment? Answer in one paragraph."), and a head trained on the target's answers to them learns
those answers' openings. These prompts were written for this project (2026-12-01) as individual
messages, one source per file (`natural-<name>` reads natural_<name>.jsonl):
- `natural-life`: everyday life (cooking, home, travel, money, work, relationships, hobbies, ...);
- `natural-tasks`: knowledge and tasks (science, history, computers, coding, math, writing,
  rewriting and extraction over an included passage, recommendations, ...);
- `natural-talk`: conversation and creative or personal requests (opinions, dilemmas, role-play,
  stories and poems with specific details, games, replies to a pasted email or message, plans);
- `natural-study`: students and working people (homework in every subject, exams, business,
  spreadsheets, programming with pasted errors, IT troubleshooting, paperwork, grammar);
and, a second round (same day, four more writers, each told only its area and the format):
- `natural-help`: practical help (devices and apps, home repair, garden, pets, cars, fitness,
  parenting, moving, shopping, events, recipes, budgets, paperwork);
- `natural-write`: writing and editing (rewrite, shorten, re-tone or summarise a pasted text,
  extract items from it, draft emails, letters, toasts, posts, descriptions, poems; translate);
- `natural-curious`: curiosity and explanations (nature, space, the body, history, words, money,
  culture, "difference between", "explain like I'm 10", recommendations with reasons);
- `natural-code`: code, data and math (functions in a dozen languages, pasted snippets, bugs and
  tracebacks, regex, git, spreadsheets, SQL, pandas; word problems, algebra, probability);
and a third round (2026-12-01, four more writers, the same instructions about independence):
- `natural-pasted`: requests over a pasted passage the writer invented (emails, notes, reviews,
  logs, tables, clauses, abstracts, story excerpts): summarise, answer, extract, proofread, reply;
- `natural-casual`: short, messy everyday messages (greetings, typos, slang, non-native phrasing,
  quick facts and conversions, jokes and word games, "is it normal that ...");
- `natural-pro`: work and domain questions (marketing, HR, small business, finance basics, plain-
  language law, general health information, trades, research, teaching, product, logistics, ...);
- `natural-format`: requests for a stated output form or constraint (lists, tables, JSON, exact
  sentence counts, poems of a given form, ELI5, quizzes, flashcards, tone rewrites, role-play);
~800 each, in varied lengths, tones and constraints, one in six to one in fourteen multi-turn. Each line of a file is
{"turns": [user, assistant, user, ...]} (an odd number of turns, user first and last).

The writers never saw the evaluation suites (experiments/prompts/); tests/test_eagle_training.py
checks every source against all of them. Prompts that coincided with an evaluation prompt by chance
were removed when that check first ran: ten of the first round (e.g. "why do cats purr"), two of the
second ("what should I look for when buying a ..."), six of the third ("how do bees make honey",
"Write a haiku about the first snow of winter.", ...).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from specdec.training.prompts import Prompt, register

HERE = Path(__file__).parent


def load(files: list[Path]) -> list[Prompt]:
    """Every prompt of `files`, in file order, each turn stripped, duplicates (by text) dropped.
    ValueError naming the file and line for a line that is not a chat with an odd number of turns."""
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
            key = "\n".join(m["content"] for m in prompt)
            if key not in seen:
                seen.add(key)
                out.append(prompt)
    return out


def _source(name: str):
    def prompts(n: int, seed: int = 0) -> list[Prompt]:
        """Up to `n` of the prompts of natural_<name>.jsonl, in an order shuffled under `seed`."""
        pool = load([HERE / f"natural_{name}.jsonl"])
        random.Random(f"natural-{name}-{seed}").shuffle(pool)
        return pool[:n]
    return prompts


for _name in sorted(p.stem.removeprefix("natural_") for p in HERE.glob("natural_*.jsonl")):
    register(f"natural-{_name}")(_source(_name))
