"""The certificate's batched cases: every row of `specdec.generate_batch` follows the target's law.

Owns `BATCH_PROMPTS` (three prompts of different lengths) and `batch_case`: n seeded batches through
`generate_batch`, each row's first tokens tested against its own prompt's exact law (`cases.exact_law`); the case's
p-value is the smallest row's, Bonferroni-corrected. A greedy case wants each row token for token. A drafter that
cannot batch gets no batched case. Knows nothing about mutants or particular drafters.
"""

from __future__ import annotations

from collections import Counter

import specdec
from specdec.certify.cases import LENGTH, SAMPLE_PROMPT, SAMPLINGS, CaseResult, chi_square_p, exact_law
from specdec.core.draft import Drafter
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import AutoShape, ShapeSpec
from specdec.runtime.model import Target

BATCH_PROMPTS = (SAMPLE_PROMPT, SAMPLE_PROMPT[:2], (4, *SAMPLE_PROMPT, 4, 1, 2))
"""Three prompts of different lengths (5, 2 and 8 tokens): the shorter rows carry holes."""
GREEDY_LENGTH = 12
"""Tokens per row of a greedy batched case."""


def batch_case(target: Target, drafter: Drafter, shape: str | ShapeSpec, sampling_name: str, n: int,
               length: int = LENGTH, cache: str = "auto") -> CaseResult | None:
    """n generations per row in batches of `BATCH_PROMPTS` (batch b's rows seeded b * 3 + row), each
    row tested against its prompt's exact law; `sampling_name` "greedy": one batch of
    `GREEDY_LENGTH` tokens, each row token for token the reference's. None when the drafter cannot batch."""
    if not getattr(drafter, "batchable", False):
        return None
    greedy = sampling_name == "greedy"
    sampling = SamplingConfig() if greedy else SAMPLINGS[sampling_name]
    n, length = (1, GREEDY_LENGTH) if greedy else (n, length)
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
                result.count(out.stats.steps)
        laws = [exact_law(target, p, sampling, set(), length) for p in BATCH_PROMPTS]
        if greedy:
            wrong = [row for row, (c, law) in enumerate(zip(counts, laws)) if set(c) != set(law)]
            result.p_value = 0.0 if wrong else 1.0
            result.problem = f"rows {wrong} differ from the greedy reference" if wrong else None
            return result
        ps = [chi_square_p(c, law, n) for c, law in zip(counts, laws)]
        result.p_value = min(1.0, len(ps) * min(ps))
    except Exception as err:  # noqa: BLE001 -- any error of the drafter or the loop fails this case, named
        result.problem = f"{type(err).__name__}: {err}"
    return result
