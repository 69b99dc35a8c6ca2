"""The attention function specdec's targets run: transformers' SDPA, minus a copy under masks on CPU.

Owns `sdpa_gqa`, registered with transformers' `AttentionInterface` as `specdec_sdpa`, and
`use_gqa_attention`, which `specdec.load_target` applies to every model loaded with the default
attention. Knows nothing about caches, trees or drafting.

Why it exists: a grouped-query model (SmolLM2: 9 query heads over 3 key/value heads) reads each
key/value head for several query heads. transformers' SDPA path lets the kernel do that
(`enable_gqa`) only when the forward carries no mask, since CUDA's fused kernels need that; with
a mask it first copies every layer's cached keys and values once per query head (`repeat_kv`).
(A single query under a mask, a padded batch's decoding step, it avoids the copy by folding the
query heads instead.) Every tree verification carries a mask, so on a CPU that copy is a visible
share of a verification (`scripts/bench_attention.py` measures it). torch's CPU SDPA reads
grouped heads under a mask as well, so here the masked multi-query CPU case passes the mask and
`enable_gqa` straight to `F.scaled_dot_product_attention`: the same logits bit for bit in our
tests (`tests/test_attention.py`). Everything else (no mask, one query, CUDA or another device,
dropout, position biases, soft-capping, attention outputs) goes to transformers' own
`sdpa_attention_forward` unchanged, and transformers builds the same masks for both names.
`scripts/bench_attention.py` measures the saving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "specdec_sdpa"


def sdpa_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, heads, n, D]
    key: torch.Tensor,  # [B, kv_heads, S, D]
    value: torch.Tensor,  # [B, kv_heads, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, n, S] additive or boolean, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([B, n, heads, D], None)."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = (dropout == 0.0 and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
             and not kwargs.get("output_attentions", False))
    if attention_mask is None or query.shape[2] == 1 or not grouped or not plain or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=True)  # [B, heads, n, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_gqa)
# transformers builds masks per attention name and builds none for a name it does not know (a causal
# chain after cached entries, or left padding, would then go unmasked): ours takes sdpa's masks.
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_gqa_attention(model: torch.nn.Module) -> bool:
    """Switch a model that runs transformers' `sdpa` to `specdec_sdpa`; True when switched. A model
    loaded with another attention (eager, flash, a user's choice) is left as it is."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True
