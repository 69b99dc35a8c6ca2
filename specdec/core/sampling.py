"""Sampling settings and the one function that turns target logits into the target distribution.

Owns `SamplingConfig` and `target_probs_from_logits`, which defines *the* distribution (after top-k / top-p)
speculative sampling must reproduce. Knows nothing about drafts or caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How the target samples. temperature = 0 means greedy (argmax)."""

    temperature: float = 0.0
    """Softmax temperature; 0 = greedy decoding. Must be >= 0. Any T > 0, however small (1e-40 in a
    float32 forward included), samples softmax(logits / T), computed without overflow: as T -> 0 it
    becomes the uniform law on the tokens tied at the maximum logit (greedy picks the first of them)."""
    top_k: int = 0  # Keep only the k most likely tokens before sampling; 0 = no top-k filter. Must be >= 0.
    top_p: float = 1.0  # Nucleus filter: keep the smallest set of tokens whose mass reaches top_p. In (0, 1].
    seed: int = 0  # Seed of the torch.Generator that drives every random choice of one generation.

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs_from_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Target distribution for sampling. logits [..., V] -> probs [..., V] (float32 or wider).

    Temperature, then top-k (ties with the k-th kept), then top-p (ties in index order), as transformers'
    warpers; greedy configs give the one-hot of the argmax (first index on ties). Logits are shifted by their
    maximum first, so a tiny temperature cannot overflow (inf - inf = nan)."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    shifted = logits.to(work_dtype)
    shifted = shifted - shifted.amax(-1, keepdim=True)  # <= 0, exactly 0 at the maximum
    # A temperature that rounds to 0 in work_dtype (5e-324 in float32) would make 0 / 0 = nan there.
    scaled = torch.where(shifted == 0, shifted, shifted / sampling.temperature)
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # ties: the lower index first
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p  # keeps the token that crosses top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
