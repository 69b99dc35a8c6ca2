"""The slow, cacheless reference: the oracle every exactness test compares against.

Owns `reference_generate`: each token from a full forward of the whole sequence, no KV cache, no tree mask, no drafting.
Shares only `target_probs_from_logits` with the fast path, because that function *defines* the target distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.runtime.model import Target
from specdec.core.sampling import SamplingConfig, target_probs_from_logits


@torch.inference_mode()
def next_token_logits(target: Target, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [V] after `token_ids`, from one full cacheless forward of the plain HF model."""
    ids = torch.tensor([list(token_ids)], device=target.device)
    return target.model(input_ids=ids, use_cache=False).logits[0, -1]


def reference_generate(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_on_eos: bool = True,
) -> list[int]:
    """New token ids, one full forward per token (EOS included when generation stops on it)."""
    generator = torch.Generator(device=target.device).manual_seed(sampling.seed)
    ids, new = list(prompt_ids), []
    eos = target.eos_token_ids if stop_on_eos else set()
    for _ in range(max_new_tokens):
        probs = target_probs_from_logits(next_token_logits(target, ids), sampling)
        token = int(probs.argmax()) if sampling.greedy else int(torch.multinomial(probs, 1, generator=generator))
        ids.append(token)
        new.append(token)
        if token in eos:
            break
    return new

