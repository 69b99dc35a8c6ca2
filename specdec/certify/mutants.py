"""Mutants of the real code (acceptance, draft sampler, target law, tree forward, cache rollback):
the wrong rules a certificate must catch.

Owns `MUTANTS` (each one small textual edit of one real function, `Mutant`) and `mutated`, which swaps in the
edited function's code object (`function.__code__`) for a `with` block, so every reference sees the mutant, and
undoes it on exit. When the real source no longer contains a mutant's text, `mutated` raises `MutantDoesNotApply`
(the certificate then fails).
Knows nothing about certificates or statistics: `specdec.certify.power` runs a reference case under each mutant.
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
    """A module-level function of `module`, or `Class.method` (an undecorated method)."""
    old: str
    """Text that must occur exactly once in the function's source."""
    new: str
    """What replaces it."""
    why: str
    """The bug in one sentence."""
    case: str = "point-mass siblings"
    """The reference case (`specdec.certify.power.REFERENCE_CASES`) run under the mutant."""


_ACCEPTANCE, _GROW, _MODEL, _CACHE = ("specdec.core.acceptance", "specdec.core.grow", "specdec.runtime.model",
                                      "specdec.runtime.cache")
MUTANTS: tuple[Mutant, ...] = (
    # the acceptance walk over siblings
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
           "each sibling's residual is taken from the original target (rejected siblings come back)", "sampled siblings"),
    Mutant("resample_from_target", _ACCEPTANCE, "accept_sampling",
           "probs = residual_probs(probs, child_draft)", "probs = target_probs[node + 1]",
           "after a rejection the next sibling and the recovered token use the target, not the residual", "sampled siblings"),
    Mutant("first_sibling_draft", _ACCEPTANCE, "accept_sampling",
           "draft.draft_probs[0, child]", "draft.draft_probs[0, kids[node][0]]",
           "later siblings are judged with the first sibling's draft distribution", "sampled siblings"),
    # bug classes engines have shipped
    Mutant("always_accept", _ACCEPTANCE, "accept_sampling",
           "u = torch.rand((), generator=generator, device=device)",
           "u = 0.0 * torch.rand((), generator=generator, device=device)",
           "the uniform draw is 0: every draft token the target allows is accepted"),
    Mutant("greedy_at_temperature", _ACCEPTANCE, "accept", "if sampling.greedy:", "if True:",
           "verification takes the target's argmax at T > 0 (accepts the draft only where it is the argmax)"),
    Mutant("missing_draft_probs_as_target", _ACCEPTANCE, "accept_sampling",
           "child_draft[x] = 1.0", "child_draft[x] = probs[x]",
           "a draft without draft_probs is read as drawn from the target (ratio 1: always accepted), not as "
           "the point mass the verifier must assume"),
    Mutant("accept_row_off_by_one", _ACCEPTANCE, "accept_sampling",
           "probs = target_probs[node + 1]  # [V]", "probs = target_probs[max(node, 0)]  # [V]",
           "after an accepted node the next token is drawn from its parent's row, the law that drew the "
           "node itself (it tends to repeat it)", "shifted chain"),
    Mutant("rollback_keeps_one_more", _CACHE, "KVCache.keep", "self.truncate(start + n)",
           "self.truncate(min(start + n + 1, self.next_position))",
           "the rollback of a chain keeps one entry past the accepted path (a rejected token stays in the cache)",
           "shifted chain"),
    Mutant("keep_ignores_path", _CACHE, "KVCache.keep",
           "self._select(torch.cat([torch.arange(begin), begin + offsets]))", "self.truncate(start + n)",
           "the keep path of a tree keeps the block's first entries, not the accepted nodes", "greedy siblings"),
    Mutant("tree_positions_in_chain", _MODEL, "tree_block", "first_position + visible.sum(1) - 1",
           "first_position + block + torch.arange(n, device=parents.device)",
           "tree nodes sit at chain positions (their index in the block), not at their depth", "greedy siblings"),
    Mutant("batch_rows_at_stored_length", _MODEL, "Target._forward_rows", "starts = cache.next_positions",
           "starts = torch.full_like(cache.next_positions, cache.length)",
           "every batch row's new tokens sit at the shared stored length, not at the row's own next position",
           "batch rows"),
    # the draft sampler and the target law
    Mutant("draft_probs_ignore_truncation", _GROW, "_grow_chain",
           "probs.append(p)", "probs.append((logits.double() / sampling.temperature).softmax(-1).to(p.dtype))",
           "a sampled chain records softmax(logits / T) as its draft probabilities, though it sampled "
           "from the top-k / top-p distribution", "shifted chain"),
    Mutant("draft_sampler_ignores_temperature", _GROW, "_grow_chain",
           "column = torch.multinomial(p, 1, generator=generator)",
           "column = torch.multinomial(target_probs_from_logits(logits, type(sampling)(1.0, sampling.top_k, "
           "sampling.top_p)), 1, generator=generator)",
           "a sampled chain draws its tokens at T = 1 and records the law at the asked temperature", "shifted chain"),
    Mutant("draft_probs_from_bf16", _GROW, "_grow_chain",
           "probs.append(p)", "probs.append(target_probs_from_logits(logits.bfloat16(), sampling).to(p.dtype))",
           "a sampled chain records draft probabilities from its logits rounded to bf16, though it sampled "
           "from the fp32 ones", "shifted chain"),
    Mutant("nucleus_on_untempered", "specdec.core.sampling", "target_probs_from_logits",
           "sorted_probs, order = probs.sort(", "sorted_probs, order = shifted.softmax(-1).sort(",
           "top-p picks its nucleus on the softmax before the temperature", "shifted chain"),
)
"""The wrong rules a certificate must catch, each a one-line edit of the real code."""


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
    function = module
    for part in m.function.split("."):
        function = getattr(function, part)
    lines, first = inspect.getsourcelines(function)
    source = textwrap.dedent("".join(lines))
    if source.count(m.old) != 1:
        raise MutantDoesNotApply(f"mutant {m.name!r}: {m.old!r} occurs {source.count(m.old)} times in "
                                 f"{m.module}.{m.function}, expected once; update specdec/certify/mutants.py")
    padded = "\n" * (first - 1) + source.replace(m.old, m.new)  # tracebacks show the real line numbers
    code = compile(padded, inspect.getsourcefile(function), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict = {}
    exec(code, module.__dict__, namespace)  # defines the edited function in `namespace` only
    saved = function.__code__
    function.__code__ = namespace[m.function.split(".")[-1]].__code__
    try:
        yield
    finally:
        function.__code__ = saved
