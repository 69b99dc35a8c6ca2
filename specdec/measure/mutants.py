"""Mutants of the real acceptance code and draft sampler: the wrong rules a certificate must catch.

Owns `MUTANTS` (each one small textual edit of one real function, `Mutant`) and `mutated`, which
applies an edit for the duration of a `with` block by compiling the edited source of the function
and swapping its code object in place (`function.__code__`). Every reference to the function sees
the mutant (the loop's `from ... import accept`, the growers' dispatch table), nothing is copied
or re-implemented, and the edit is undone on exit. When the real source no longer contains the text
a mutant edits, `mutated` raises `MutantDoesNotApply` naming it (a certificate then fails: its
power would otherwise be claimed for code it never ran).

Knows nothing about certificates or statistics: `specdec.certify` runs its cases under each mutant.
"""

from __future__ import annotations

import __future__
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class MutantDoesNotApply(RuntimeError):
    """The real function no longer contains the text a mutant edits."""


@dataclass(frozen=True)
class Mutant:
    """One wrong rule, as an edit of one real function's source."""

    name: str
    module: str
    """Module that defines the function, e.g. `specdec.core.acceptance`."""
    function: str
    """Name of a module-level function in `module`."""
    old: str
    """Text that must occur exactly once in the function's source."""
    new: str
    """What replaces it."""
    why: str
    """The bug in one sentence."""


_ACCEPTANCE = "specdec.core.acceptance"
MUTANTS: tuple[Mutant, ...] = (
    Mutant("no_residual_normalisation", _ACCEPTANCE, "residual_probs",
           "return residual / mass if mass > 0", "return residual if mass > 0",
           "the residual max(0, target - draft) is not renormalised (later siblings are judged against it)"),
    Mutant("accept_against_original", _ACCEPTANCE, "accept_sampling",
           "acceptance_probability(probs[x], child_draft[x])",
           "acceptance_probability(target_probs[node + 1][x], child_draft[x])",
           "later siblings are accepted against the node's original target, not the running residual"),
    Mutant("residual_from_original", _ACCEPTANCE, "accept_sampling",
           "probs = residual_probs(probs, child_draft)",
           "probs = residual_probs(target_probs[node + 1], child_draft)",
           "each sibling's residual is taken from the original target (rejected siblings come back)"),
    Mutant("resample_from_target", _ACCEPTANCE, "accept_sampling",
           "probs = residual_probs(probs, child_draft)", "probs = target_probs[node + 1]",
           "after a rejection the next sibling and the recovered token use the target, not the residual"),
    Mutant("first_sibling_draft", _ACCEPTANCE, "accept_sampling",
           "draft.draft_probs[0, child]", "draft.draft_probs[0, kids[node][0]]",
           "later siblings are judged with the first sibling's draft distribution"),
    Mutant("always_accept", _ACCEPTANCE, "accept_sampling",
           "u = torch.rand((), generator=generator, device=device)",
           "u = 0.0 * torch.rand((), generator=generator, device=device)",
           "the uniform draw is 0: every draft token the target allows is accepted"),
    Mutant("greedy_at_temperature", _ACCEPTANCE, "accept", "if sampling.greedy:", "if True:",
           "verification takes the target's argmax at T > 0 (accepts the draft only where it is the argmax)"),
    Mutant("draft_probs_ignore_truncation", "specdec.core.grow", "_grow_chain",
           "probs.append(p)", "probs.append((logits.double() / sampling.temperature).softmax(-1).to(p.dtype))",
           "a sampled chain records softmax(logits / T) as its draft probabilities, though it sampled "
           "from the top-k / top-p distribution"),
)
"""The wrong rules of issue 33, each a one-line edit of the real code."""


def mutant(name: str) -> Mutant:
    """The mutant called `name` (KeyError naming the known ones)."""
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"unknown mutant {name!r}; known: {', '.join(m.name for m in MUTANTS)}")


@contextmanager
def mutated(m: Mutant) -> Iterator[None]:
    """Run the real `m.module.m.function` with `m.old` replaced by `m.new` inside the block."""
    module = importlib.import_module(m.module)
    function = getattr(module, m.function)
    lines, first = inspect.getsourcelines(function)
    source = textwrap.dedent("".join(lines))
    if source.count(m.old) != 1:
        raise MutantDoesNotApply(f"mutant {m.name!r}: {m.old!r} occurs {source.count(m.old)} times in "
                                 f"{m.module}.{m.function}, expected once; update specdec/measure/mutants.py")
    padded = "\n" * (first - 1) + source.replace(m.old, m.new)  # tracebacks show the real line numbers
    code = compile(padded, inspect.getsourcefile(function), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict = {}
    exec(code, module.__dict__, namespace)  # defines the edited function in `namespace` only
    saved = function.__code__
    function.__code__ = namespace[m.function].__code__
    try:
        yield
    finally:
        function.__code__ = saved
