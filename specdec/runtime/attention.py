"""The attention function specdec's targets run: transformers' SDPA, minus a copy under masks on CPU. Owns `sdpa_gqa`
(`specdec_sdpa`: a masked multi-query CPU forward passes `enable_gqa` to SDPA instead of `repeat_kv`, bit-identical;
traced by `torch.compile` on a CPU, the attention as float32 products and a softmax, which inductor fuses: SDPA's
CPU kernel has a fixed cost per call that dominates at one query row) and `use_gqa_attention` (applied by
`load_target`). Knows nothing about caches, trees or drafting.
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
    if plain and attention_mask is not None and query.device.type == "cpu" and torch.compiler.is_compiling():
        return _products(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling)
    if attention_mask is None or query.shape[2] == 1 or not grouped or not plain or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=True)  # [B, heads, n, D]
    return out.transpose(1, 2).contiguous(), None


def _products(query, key, value, mask, scale: float) -> tuple[torch.Tensor, None]:
    """softmax(q k^T * scale + mask) v in float32, query heads grouped over their key head (no `repeat_kv` copy);
    mask [B, 1, n, S] additive or boolean. ([B, n, heads, D] in the query's dtype, None)"""
    b, heads, n, d = query.shape
    kv = key.shape[1]
    q = query.reshape(b, kv, heads // kv, n, d).float()
    scores = q @ key.unsqueeze(2).transpose(-1, -2).float() * scale  # [B, kv, group, n, S]
    mask = mask.unsqueeze(1)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    out = torch.softmax(scores, -1) @ value.unsqueeze(2).float()  # [B, kv, group, n, D]
    return out.reshape(b, heads, n, d).transpose(1, 2).contiguous().to(query.dtype), None


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
