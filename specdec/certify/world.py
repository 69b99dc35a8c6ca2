"""The tiny fp64 models a certificate runs on, built so that a wrong position changes their output.

Owns `World` / `tiny_world` and `positional`, which rewrites a tiny causal LM (llama, qwen2 or mistral) into a
position-keyed one: its first layer's heads each read the token a fixed distance back (`OFFSETS`, RoPE of constant
queries and keys, `FREQUENCIES`), so a tree node or batch row at the wrong position changes the logits.
Constructed, not trained. Knows nothing about drafters, cases or mutants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import specdec
from specdec.runtime.model import Target

VOCAB = 5
"""Vocabulary of the T > 0 models: small enough to enumerate V^LENGTH sequences exactly."""
FAMILIES = ("llama", "qwen2", "mistral")
OFFSETS = (1, 2, 3, 5)
"""How far back each of the four heads of the first layer reads."""
FREQUENCIES = (0.41, 0.93, 1.37, 1.78, 2.21, 2.57, 2.96, 0.67)
"""RoPE frequencies (radians per position) of the position-keyed models: spread over (0, pi), so a
head's score peaks at its offset and is well below the peak at every other distance up to 64."""
SHARPNESS = 6.0
"""Amplitude of the constant queries: a head's score at its offset exceeds every other distance's
by several nats, so attention lands on one token."""


@dataclass(frozen=True)
class World:
    """The tiny models a certificate runs on."""

    greedy_targets: tuple[Target, ...]
    """Position-keyed fp64 targets (vocab 64), one per model family, for the token-exact greedy identity."""
    target: Target
    """Position-keyed fp64 target with a VOCAB-token vocabulary for the distribution tests."""
    draft_model: Target
    """A different (random) fp64 model on the same vocabulary: the `model=` of drafters that take one."""
    flat_target: Target
    """A flatter (random) fp64 VOCAB-token target (logit scale 1.5): the sibling reference cases."""


def tiny_world() -> World:
    """Build the certificate's models (seeded: every run sees the same weights)."""
    greedy = tuple(positional(specdec.tiny_target(f, vocab_size=64, hidden_size=64, dtype=torch.float64), 4.0, seed)
                   for seed, f in enumerate(FAMILIES))
    small = dict(vocab_size=VOCAB, hidden_size=16, dtype=torch.float64)
    target = specdec.tiny_target("llama", vocab_size=VOCAB, hidden_size=64, dtype=torch.float64, seed=0)
    return World(greedy, positional(target, logit_scale=0.2),
                 specdec.tiny_target("llama", seed=7, logit_scale=6.0, **small),
                 specdec.tiny_target("llama", seed=3, logit_scale=1.5, **small))


@torch.no_grad()
def positional(target: Target, logit_scale: float = 1.0, seed: int = 0) -> Target:
    """Rewrite `target`'s weights in place into the position-keyed model (see the module doc).

    Layout of the residual [H]: dims 0..H/2-1 the current token's code (unit norm), dim H/2 a
    constant 1, the rest what the heads wrote. After the input norm the constant is c = sqrt(H / 2);
    query head h holds A (cos d_h theta_j, -sin d_h theta_j) per frequency pair j, every key
    (1, 0), so q . R(delta) k = A sum_j cos((delta - d_h) theta_j): the peak is at delta = d_h. Later
    layers pass the residual through (zero attention and MLP outputs)."""
    model, g = target.model, torch.Generator().manual_seed(seed)
    hidden, vocab = target.hidden_size, target.vocab_size
    layer = model.model.layers[0].self_attn
    heads, head_dim = len(OFFSETS), layer.q_proj.out_features // len(OFFSETS)
    half, code, const = head_dim // 2, hidden // 2, hidden // 2
    if half != len(FREQUENCIES) or layer.k_proj.out_features != 2 * head_dim:
        raise ValueError(f"positional needs 4 query heads over 2 kv heads of dim {2 * len(FREQUENCIES)}, "
                         f"got hidden {hidden}: build the tiny target with hidden_size={8 * len(FREQUENCIES)}")
    for name, p in model.named_parameters():
        p.fill_(1.0) if "norm" in name else p.zero_()
    dtype = model.dtype
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    codes = randn(vocab, code)
    model.get_input_embeddings().weight[:, :code] = codes / codes.norm(dim=1, keepdim=True)
    model.get_input_embeddings().weight[:, const] = 1.0
    theta = torch.tensor(FREQUENCIES, dtype=torch.float64)
    model.model.rotary_emb.inv_freq.copy_(theta)
    if hasattr(model.model.rotary_emb, "original_inv_freq"):
        model.model.rotary_emb.original_inv_freq = theta.clone()
    c = math.sqrt(hidden / 2)
    for h, d in enumerate(OFFSETS):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        query = torch.cat([torch.cos(d * theta), -torch.sin(d * theta)]) * SHARPNESS / c
        layer.q_proj.weight[rows, const] = query.to(dtype)
    for kv in range(2):
        layer.k_proj.weight[kv * head_dim: kv * head_dim + half, const] = 1.0 / c
        layer.v_proj.weight[kv * head_dim: (kv + 1) * head_dim, :code] = randn(head_dim, code) / math.sqrt(code) / c
    layer.o_proj.weight[const + 1:, :] = randn(hidden - const - 1, heads * head_dim) / math.sqrt(head_dim)
    model.get_output_embeddings().weight.copy_(randn(vocab, hidden) * logit_scale)
    return target
