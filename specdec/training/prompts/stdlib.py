"""The `stdlib` prompt source: tasks over passages from Python's standard-library docstrings.

The passages are the docstrings of public functions and classes of a fixed list of standard-library
modules (text under the PSF licence, shipped with every Python interpreter, so no download), wrapped
in this module's own task phrasings: summarise, explain with an example, rewrite for a beginner,
extract the parameters, write a test, answer a question. The exact passages follow the interpreter's
version (docstrings change between Python releases), so the prompt list is deterministic per seed
and Python version.
"""

from __future__ import annotations

import importlib
import inspect
import random

from specdec.training.prompts import Prompt, register

MODULES = ["json", "os.path", "string", "textwrap", "itertools", "functools", "collections", "random",
           "statistics", "datetime", "re", "shutil", "heapq", "bisect", "fractions", "calendar", "csv",
           "difflib", "glob", "fnmatch", "secrets", "uuid", "zipfile", "urllib.parse", "math", "operator",
           "pathlib", "copy", "base64", "hashlib", "html", "gzip", "tempfile", "contextlib", "enum"]
TASKS = [
    "Summarise this Python documentation in plain English:\n\n{doc}",
    "Explain what `{name}` does and show a short usage example. Its documentation says:\n\n{doc}",
    "Rewrite this description so that a beginner programmer understands it:\n\n{doc}",
    "Which arguments does `{name}` take, according to this text? List them.\n\n{doc}",
    "Write a unit test for `{name}`, described as follows:\n\n{doc}",
    "When would I use `{name}` instead of writing the code myself?\n\n{doc}",
    "Give three bullet points about `{name}` based on this:\n\n{doc}",
]


def passages(min_chars: int = 60, max_chars: int = 600) -> list[tuple[str, str]]:
    """(qualified name, first paragraph of its docstring) for public callables of MODULES, in a fixed order."""
    out, seen = [], set()
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            if not callable(obj):
                continue
            doc = (inspect.getdoc(obj) or "").split("\n\n")[0].strip()
            if min_chars <= len(doc) <= max_chars and doc not in seen:
                seen.add(doc)
                out.append((f"{module_name}.{attr}", doc))
    return out


@register("stdlib")
def stdlib_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """Up to `n` distinct tasks over standard-library docstrings (fewer if the passages run out)."""
    r = random.Random(f"stdlib-{seed}")
    pool = passages()
    r.shuffle(pool)
    out = []
    for i, (name, doc) in enumerate(pool[:n]):
        out.append(({"role": "user", "content": r.choice(TASKS).format(name=name, doc=doc)},))
    return out
