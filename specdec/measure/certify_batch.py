"""The certificate's batched cases: every row of `specdec.generate_batch` follows the target's law.

Owns `BATCH_PROMPTS` (three prompts of different lengths) and `batch_case`: n seeded batches of those
prompts through `generate_batch`, each row's first tokens counted apart and tested against the exact
law of its own prompt (`certify_cases.exact_law`); the case's p-value is the smallest row's,
Bonferroni-corrected for the three rows. It sees each row's marginal law (a row reading a
neighbour's randomness or cache would move it). On the certificate's vocabulary-5 target a wrong
per-row rollback barely moves the law, so `tests/test_batch.py` catches that bug by greedy identity
on a context-sensitive target instead (a `keep_rows` mutant fails it). A drafter that cannot batch
gets no batched case (`generate_batch` refuses it before any work). The per-draft checks of
`certify_cases.Recorder` run in the batch-of-one cases; here the drafter runs bare.
Knows nothing about mutants or particular drafters.
"""

from __future__ import annotations

from collections import Counter

import specdec
from specdec.core.draft import Drafter
from specdec.core.shapes import AutoShape, ShapeSpec
from specdec.measure.certify_cases import LENGTH, SAMPLE_PROMPT, SAMPLINGS, CaseResult, chi_square_p, exact_law
from specdec.runtime.model import Target

BATCH_PROMPTS = (SAMPLE_PROMPT, SAMPLE_PROMPT[:2], (4, *SAMPLE_PROMPT, 4, 1, 2))
"""Three prompts of different lengths (5, 2 and 8 tokens): the shorter rows carry holes."""


def batch_case(target: Target, drafter: Drafter, shape: str | ShapeSpec, sampling_name: str, n: int,
               length: int = LENGTH, cache: str = "auto") -> CaseResult | None:
    """n generations per row in batches of `BATCH_PROMPTS` (batch b's rows seeded b * 3 + row), each
    row tested against its prompt's exact law; None when the drafter cannot batch."""
    if not getattr(drafter, "batchable", False):
        return None
    sampling = SAMPLINGS[sampling_name]
    label = "auto" if isinstance(shape, AutoShape) else str(shape)
    result = CaseResult(label, sampling_name, False, n, 0.0, cache=cache, prompt=f"batch of {len(BATCH_PROMPTS)}")
    counts = [Counter() for _ in BATCH_PROMPTS]
    try:
        for batch in range(n):
            outs = specdec.generate_batch(target, drafter, [list(p) for p in BATCH_PROMPTS], shape=shape,
                                          max_new_tokens=length, temperature=sampling.temperature,
                                          top_k=sampling.top_k, top_p=sampling.top_p, seed=batch * len(BATCH_PROMPTS),
                                          stop_on_eos=False, cache=cache)
            for row, out in enumerate(outs):
                counts[row][tuple(out.token_ids)] += 1
                for s in out.stats.steps:
                    result.steps += 1
                    result.drafted += s.drafted
                    result.accepted += s.accepted
                    result.rejections += bool(s.drafted) and not s.bonus
        ps = [chi_square_p(c, exact_law(target, p, sampling, set(), length), n) for c, p in zip(counts, BATCH_PROMPTS)]
        result.p_value = min(1.0, len(ps) * min(ps))
    except Exception as err:  # noqa: BLE001 -- any error of the drafter or the loop fails this case, named
        result.problem = f"{type(err).__name__}: {err}"
    return result

