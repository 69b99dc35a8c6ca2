"""The EAGLE head: a one-layer autoregressive model over a target's features, and its file format.

Owns `EagleHead` (the trainable nn.Module), `HeadConfig` (what a head was built for), the draft vocabulary (target
token ids ranked by training-data frequency) and saving/loading a head as safetensors + a small JSON config. It does
NOT own the target's embedding or lm_head: those stay the target's (frozen, shared) and are passed in by the caller.

    x_i = fc(concat(embed(t_{i+1}), h_i))        # [B, n, 2H] -> [B, n, H]
    f_i = norm(decoder_layer(x_i))               # predicted feature ~ h_{i+1}
    logits_i = lm_head(f_i)                      # next-token logits after t_{i+1}

With `aux_layers` (EAGLE-3), x_i adds `fc_aux(concat(norm_1(a_i^1), ..., norm_k(a_i^k)))`, fc_aux starting at zero
(so `widen` starts a fused head from a plain one exactly); pairs reading the head's own predicted feature pass none.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

FORMAT_VERSION = 1


@dataclass(frozen=True)
class HeadConfig:
    """What an EAGLE head was built for, and its layer geometry (saved as `<name>.json`)."""

    target_name: str
    """Name of the target whose features the head reads (e.g. 'smollm2-135m')."""
    hidden_size: int
    """Target hidden size H (width of features, embeddings and the head)."""
    vocab_size: int
    """Target vocabulary size V (the lm_head the head is scored with)."""
    num_attention_heads: int
    """Query heads of the head's decoder layer."""
    num_key_value_heads: int
    """Key/value heads of the head's decoder layer."""
    head_dim: int
    """Per-head width of the head's decoder layer."""
    intermediate_size: int
    """MLP width of the head's decoder layer."""
    rms_norm_eps: float = 1e-5
    """Epsilon of the head's RMS norms."""
    rope_theta: float = 10000.0
    """RoPE base of the head's attention."""
    draft_vocab_size: int = 0
    """Length of the stored frequency-ranked draft vocabulary (0 = none stored)."""
    aux_layers: tuple[int, ...] = ()
    """Target hidden states (index into HF `hidden_states`: k = after decoder layer k) fused into the
    projection besides the final one (EAGLE-3); () = the final hidden state only."""
    format_version: int = FORMAT_VERSION
    """Version of this file format."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(k) for k in self.aux_layers))  # JSON gives a list

    @staticmethod
    def for_target(target, draft_vocab_size: int = 0, aux_layers: tuple[int, ...] = ()) -> HeadConfig:
        """The geometry of a head for `target` (a specdec Target): the shape of one of its layers."""
        cfg = target.model.config.get_text_config()
        heads = cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        return HeadConfig(
            target_name=target.name,
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            draft_vocab_size=draft_vocab_size,
            aux_layers=tuple(aux_layers),
        )

    def check_target(self, target) -> None:
        """Raise ValueError naming every mismatch between this head and `target`."""
        problems = fit_problems(target, self.hidden_size, self.vocab_size, self.aux_layers)
        if problems:
            raise ValueError(
                f"EAGLE head trained for {self.target_name!r} does not fit target {target.name!r}: "
                + "; ".join(problems) + ". Train a head for this target with `python -m specdec.training`."
            )

    def check_same_geometry(self, other: HeadConfig, source: str | Path) -> None:
        """ValueError naming `source` (the file `self` came from) and every field where this head's
        target or geometry differs from `other` (the head a run expects); the draft vocabulary may differ."""
        mine, theirs = asdict(self), asdict(other)
        diff = {k: (mine[k], theirs[k]) for k in mine if k != "draft_vocab_size" and mine[k] != theirs[k]}
        if diff:
            raise ValueError(f"{source} holds a head for another target or head configuration "
                             f"({{field: (in file, expected)}}: {diff}); start from a matching head or from scratch")

    def llama_config(self) -> LlamaConfig:
        config = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        config._attn_implementation = "sdpa"
        return config


def fit_problems(target, hidden_size: int, vocab_size: int, aux_layers: tuple[int, ...]) -> list[str]:
    """Why a head of this width, vocabulary and aux layers cannot read `target`'s features ([] = it can)."""
    problems = []
    if hidden_size != target.hidden_size:
        problems.append(f"hidden size {hidden_size} (target has {target.hidden_size})")
    if vocab_size != target.vocab_size:
        problems.append(f"vocabulary {vocab_size} (target has {target.vocab_size})")
    layers = target.model.config.get_text_config().num_hidden_layers
    if any(not 0 <= k < layers for k in aux_layers):
        problems.append(f"aux_layers {list(aux_layers)} (hidden-state indices 0..{layers - 1} exist "
                        f"before the final one, which is always read)")
    return problems


def full_mask(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The additive mask [1 or B, 1, n, past + n] in x's dtype from [n, past + n] or [B, 1, n, past + n];
    None = plain causal over x's n rows (training)."""
    if mask is None:
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = torch.zeros(n, n, dtype=x.dtype, device=x.device).masked_fill(~causal, torch.finfo(x.dtype).min)
    return (mask[None, None] if mask.dim() == 2 else mask).to(device=x.device, dtype=x.dtype)


def attend(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
           cache: DynamicCache | None, layer_idx: int) -> torch.Tensor:
    """`attn`'s (a LlamaAttention) self-attention on normed x [B, n, W], written out: its module wiring
    costs more than its products at one or a few rows."""
    b, n, _ = x.shape
    shape = (b, n, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, heads, n, D]
    k = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, kv_heads, n, D]
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)  # [B, kv_heads, past + n, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class EagleHead(nn.Module):
    """fc(2H -> H) (+ fc_aux(kH -> H) over k normed aux layers) + one Llama decoder layer + RMS norm.
    Holds no embedding and no lm_head."""

    def __init__(self, config: HeadConfig, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        llama = config.llama_config()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        if config.aux_layers:
            k = len(config.aux_layers)
            self.aux_norms = nn.ModuleList(LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) for _ in range(k))
            self.fc_aux = nn.Linear(k * config.hidden_size, config.hidden_size, bias=False)
            nn.init.zeros_(self.fc_aux.weight)
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(llama)
        vocab = torch.empty(0, dtype=torch.long) if draft_vocab is None else draft_vocab.long()
        self.register_buffer("draft_vocab", vocab, persistent=False)  # [N] target ids, most frequent first

    scores_own_vocabulary = False
    """The drafter scores this head's features with the target's lm_head rows (its `draft_vocab` ranks them)."""
    takes_row_positions = True
    """`forward` takes positions [B, n] and masks [B, 1, n, past + n]: a drafter can run a batch's rows at once."""

    def embedding(self, target) -> nn.Module:
        """The token embedding pairs read: the target's (shared, never trained)."""
        return target.base.get_input_embeddings()

    def logit_features(self, features: torch.Tensor) -> torch.Tensor:
        """What the lm_head scores for a `forward` output: the predicted feature itself."""
        return features

    def forward(
        self,
        features: torch.Tensor,  # [B, n, H] predicted feature, or [B, n, (1 + k) H] the target's (final, then aux)
        token_embeds: torch.Tensor,  # [B, n, H] target embedding of the token at each position
        positions: torch.Tensor,  # [n] long, or [B, n]: each row at its own positions (a batch)
        mask: torch.Tensor | None,  # [n, past + n] additive, or [B, 1, n, past + n]; None = plain causal (training)
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Predicted features [B, n, H] (inputs of the target's lm_head). Features wider than H carry
        the aux layers after the final hidden state (see the module docstring); exactly H: none.
        Positions and mask are shared by the rows, or per row (`takes_row_positions`)."""
        hsize = self.config.hidden_size
        x = self.fc(torch.cat([token_embeds, features[..., :hsize]], -1).to(self.fc.weight.dtype))
        if features.shape[-1] > hsize:
            aux = features[..., hsize:].to(x.dtype).split(hsize, -1)
            if len(aux) != len(self.config.aux_layers):
                raise ValueError(f"features of width {features.shape[-1]} carry {len(aux)} aux layers; "
                                 f"this head fuses {len(self.config.aux_layers)} ({list(self.config.aux_layers)})")
            x = x + self.fc_aux(torch.cat([norm(a) for norm, a in zip(self.aux_norms, aux)], -1))
        position_ids = (positions[None] if positions.dim() == 1 else positions).to(x.device)  # [1 or B, n]
        cos, sin = self.rotary(x, position_ids)
        mask = full_mask(mask, x)
        layer = self.layer
        x = x + attend(layer.self_attn, layer.input_layernorm(x), cos, sin, mask, cache, 0)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    # ---- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write `<path>.safetensors` (weights in `dtype`, plus the draft vocabulary) and `<path>.json`."""
        path = Path(path).with_suffix("")
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        tensors["draft_vocab"] = self.draft_vocab.cpu().contiguous()
        save_file(tensors, str(path.with_suffix(".safetensors")), metadata={"format": "specdec-eagle"})
        config = {**asdict(self.config), "draft_vocab_size": int(self.draft_vocab.numel())}
        path.with_suffix(".json").write_text(json.dumps(config, indent=2) + "\n")
        return path.with_suffix(".safetensors")

    @staticmethod
    def load(path: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
        """Load a head written by `save` (safetensors only); weights cast to `dtype`."""
        path = Path(path)
        weights, meta = path.with_suffix(".safetensors"), path.with_suffix(".json")
        for f in (weights, meta):
            if not f.exists():
                raise FileNotFoundError(f"EAGLE head file {f} is missing (a head is a .safetensors + .json pair)")
        raw = json.loads(meta.read_text())
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta}: format_version {raw.get('format_version')!r}, "
                             f"this specdec reads {FORMAT_VERSION}")
        config = HeadConfig(**raw)
        tensors = load_file(str(weights))
        vocab = tensors.pop("draft_vocab")
        head = EagleHead(config, draft_vocab=vocab)
        head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
        return head.to(dtype).eval()


def widen(head: EagleHead, aux_layers: tuple[int, ...]) -> EagleHead:
    """A head fusing `aux_layers` that computes exactly what `head` (which fuses none) computes:
    its weights copied, fc_aux zero, aux norms at 1. How a fused head starts from a trained plain one."""
    if head.config.aux_layers:
        raise ValueError(f"widen starts from a head without aux layers; this one fuses {list(head.config.aux_layers)}")
    wide = EagleHead(replace(head.config, aux_layers=tuple(aux_layers)), draft_vocab=head.draft_vocab)
    missing, unexpected = wide.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("fc_aux.", "aux_norms.")) for k in missing), (missing, unexpected)
    return wide.to(head.fc.weight.dtype)


def rank_vocabulary(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target ids that occur in `token_ids`, most frequent first (ties: lower id first). [N] long."""
    counts = torch.bincount(token_ids.flatten().long(), minlength=vocab_size)  # [V]
    order = torch.argsort(-counts, stable=True)
    return order[: int((counts > 0).sum())]
