"""EAGLE-3 heads in the speculators format (what vLLM serves): `Eagle3Head`, reading and writing its directory.

Owns `Eagle3Head` (speculators 0.9.0's `Eagle3DraftModel`), `Eagle3Config`, `load_speculators`, `save_speculators`,
`export_speculators` and `package_check` (the only place that imports `speculators`); draft column j is target token
j + d2t[j], aux layer id k is HF `hidden_states[k]`. Knows nothing about drafting (specdec/drafters/eagle.py).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.drafters.eagle_head import attend, fit_problems, full_mask

MODEL_TYPE = "eagle3"  # The speculators_model_type this module reads and writes.
SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose format `save_speculators` writes (and tests/test_speculators.py checks)."""
_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")  # training-time copies of the verifier's


@dataclass(frozen=True)
class Eagle3Config:
    """What a speculators EAGLE-3 head was built for: its layer config and options (config.json)."""

    layer_config: dict
    """The transformer_layer_config as stored (a Llama config of the draft's decoder layers; its
    vocab_size is the verifier's vocabulary)."""
    aux_layers: tuple[int, ...]
    """eagle_aux_hidden_state_layer_ids: verifier layer ids (HF hidden_states indices) fused by fc."""
    draft_vocab_size: int
    """Columns of the head's lm_head (= the verifier's vocabulary when no vocabulary map is stored)."""
    target_name: str = ""  # speculators_config.verifier.name_or_path ('' when the file names none).
    verifier_architectures: tuple[str, ...] = ()  # speculators_config.verifier.architectures.
    norm_before_residual: bool = False  # Layer 0's residual is hidden_norm(g) instead of g.
    norm_before_fc: bool = False  # One RMS norm over the concatenated aux layers before fc.
    fc_norm: bool = False  # One RMS norm per aux layer before fc.
    norm_output: bool = False  # Children read norm(x) instead of x (EAGLE 3.1).
    speculative_tokens: int = 3
    """The greedy proposal's depth the file advertises (speculators_config.proposal_methods)."""
    extra: dict = field(default_factory=dict, compare=False)
    """Other config.json fields, written back unchanged by `save_speculators`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layers", tuple(int(k) for k in self.aux_layers))
        object.__setattr__(self, "verifier_architectures", tuple(self.verifier_architectures))

    @property
    def hidden_size(self) -> int:
        return int(self.layer_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.layer_config["vocab_size"])

    def check_target(self, target) -> None:
        """Raise ValueError naming the head's verifier and every mismatch with `target`."""
        problems = fit_problems(target, self.hidden_size, self.vocab_size, self.aux_layers)
        if problems:
            raise ValueError(f"speculators EAGLE-3 head for verifier {self.target_name or '(unnamed)'!r} does not fit "
                             f"target {target.name!r}: " + "; ".join(problems))

    def llama_config(self) -> LlamaConfig:
        config = LlamaConfig(**{k: v for k, v in self.layer_config.items() if k not in ("model_type", "architectures")})
        config._attn_implementation = "sdpa"
        return config


class Eagle3Head(nn.Module):
    """fc(kH -> H) + L decoder layers (layer 0's attention reads [embedding, g], 2H) + norm + its own
    lm_head over the draft vocabulary. Module names are the checkpoint's tensor names."""

    scores_own_vocabulary = True
    takes_row_positions = True  # Its forward takes per-row positions [B, n] and masks [B, 1, n, past + n] (a batch).
    """The drafter scores `logit_features` with `lm_head`, columns = `draft_vocab` (target ids)."""

    def __init__(self, config: Eagle3Config, draft_vocab: torch.Tensor | None = None, embed: bool = False) -> None:
        super().__init__()
        self.config = config
        llama = config.llama_config()
        hsize, k = config.hidden_size, len(config.aux_layers)
        self.fc = nn.Linear(k * hsize, hsize, bias=False)
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(k * hsize, eps=llama.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(hsize, eps=llama.rms_norm_eps) for _ in range(k))
        self.layers = nn.ModuleList(LlamaDecoderLayer(llama, i) for i in range(llama.num_hidden_layers))
        first, bias = self.layers[0].self_attn, llama.attention_bias
        first.q_proj = nn.Linear(2 * hsize, llama.num_attention_heads * llama.head_dim, bias=bias)
        first.k_proj = nn.Linear(2 * hsize, llama.num_key_value_heads * llama.head_dim, bias=bias)
        first.v_proj = nn.Linear(2 * hsize, llama.num_key_value_heads * llama.head_dim, bias=bias)
        self.layers[0].hidden_norm = LlamaRMSNorm(hsize, eps=llama.rms_norm_eps)
        self.norm = LlamaRMSNorm(hsize, eps=llama.rms_norm_eps)
        self.lm_head = nn.Linear(hsize, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hsize) if embed else None
        rope = copy.copy(llama)
        rope.hidden_size *= 2  # as speculators builds it (head_dim is explicit, so the frequencies do not change)
        self.rotary = LlamaRotaryEmbedding(rope)
        vocab = torch.arange(config.draft_vocab_size) if draft_vocab is None else draft_vocab.long()
        self.register_buffer("draft_vocab", vocab, persistent=False)  # [N] target id of each draft column

    def embedding(self, target) -> nn.Module:
        """The token embedding pairs read: the checkpoint's own, else the target's."""
        return self.embed_tokens if self.embed_tokens is not None else target.base.get_input_embeddings()

    def forward(
        self,
        features: torch.Tensor,  # [B, n, H] a parent's output, or [B, n, (1 + k) H] the target's (final, then aux)
        token_embeds: torch.Tensor,  # [B, n, H] embedding of the token at each position
        positions: torch.Tensor,  # [n] or [B, n] long
        mask: torch.Tensor | None,  # [n, past + n] or [B, 1, n, past + n] additive, None = plain causal
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last layer, [B, n, H] (normed with norm_output): what children read and
        `logit_features` scores. Of target features (final hidden state first), this head reads only the aux layers."""
        hsize, dtype = self.config.hidden_size, self.fc.weight.dtype
        if features.shape[-1] == hsize:
            g = features.to(dtype)
        else:
            aux = features[..., hsize:].to(dtype)  # [B, n, kH]
            if aux.shape[-1] != self.fc.in_features:
                raise ValueError(f"features of width {features.shape[-1]} carry {aux.shape[-1] // hsize} aux layers; "
                                 f"this head fuses {len(self.config.aux_layers)} ({list(self.config.aux_layers)})")
            if self.config.norm_before_fc:
                aux = self.input_norm(aux)
            if self.config.fc_norm:
                aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.split(hsize, -1))], -1)
            g = self.fc(aux)
        cos, sin = self.rotary(g, (positions[None] if positions.dim() == 1 else positions).to(g.device))
        mask = full_mask(mask, g)  # [B, 1, n, past + n]
        first = self.layers[0]
        hidden = first.hidden_norm(g)
        residual = hidden if self.config.norm_before_residual else g
        both = torch.cat([first.input_layernorm(token_embeds.to(dtype)), hidden], -1)  # [B, n, 2H]
        x = residual + attend(first.self_attn, both, cos, sin, mask, cache, 0)
        x = x + first.mlp(first.post_attention_layernorm(x))
        for i, layer in enumerate(self.layers[1:], start=1):
            x = x + attend(layer.self_attn, layer.input_layernorm(x), cos, sin, mask, cache, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x) if self.config.norm_output else x

    def logit_features(self, x: torch.Tensor) -> torch.Tensor:
        """What lm_head scores for a `forward` output x [B, n, H]."""
        return x if self.config.norm_output else self.norm(x)


def is_speculators_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding a config.json (a speculators checkpoint, to be checked by loading)."""
    return Path(path).is_dir() and (Path(path) / "config.json").exists()


def _read_config(directory: Path) -> Eagle3Config:
    meta = directory / "config.json"
    raw = json.loads(meta.read_text())
    kind = raw.get("speculators_model_type")
    if kind is None:
        raise ValueError(f"{meta} has no speculators_model_type: not a speculators checkpoint (specdec reads "
                         f"speculators_model_type {MODEL_TYPE!r}; a specdec head is a .safetensors + .json pair)")
    if kind != MODEL_TYPE:
        raise ValueError(f"{meta}: speculators_model_type {kind!r} is not supported; specdec's eagle drafter "
                         f"reads {MODEL_TYPE!r} (EAGLE-3) heads only")
    layer = dict(raw.get("transformer_layer_config") or {})
    if layer.get("model_type") != "llama":
        raise ValueError(f"{meta}: transformer_layer_config.model_type {layer.get('model_type')!r}; specdec builds "
                         "EAGLE-3 heads of Llama decoder layers only ('llama')")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise ValueError(f"{meta}: sliding-window draft layers are not supported")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden not in (None, layer.get("hidden_size")):
        raise ValueError(f"{meta}: target_hidden_size {target_hidden} differs from the draft's hidden size "
                         f"{layer.get('hidden_size')}; specdec's heads read features of their own width")
    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{meta}: eagle_aux_hidden_state_layer_ids is missing; the layer ids depend on the verifier "
                         "(speculators resolves [2, L // 2, L - 3] from it): write them into the file")
    spec = raw.get("speculators_config") or {}
    verifier = spec.get("verifier") or {}
    proposals = spec.get("proposal_methods") or [{}]
    known = {"speculators_model_type", "transformer_layer_config", "eagle_aux_hidden_state_layer_ids",
             "draft_vocab_size", "speculators_config", "target_hidden_size", *_FLAGS}
    return Eagle3Config(
        layer_config=layer, aux_layers=tuple(aux),
        draft_vocab_size=int(raw.get("draft_vocab_size", layer["vocab_size"])),
        target_name=verifier.get("name_or_path") or "",
        verifier_architectures=tuple(verifier.get("architectures") or ()),
        speculative_tokens=int(proposals[0].get("speculative_tokens", 3)),
        **{flag: bool(raw.get(flag, False)) for flag in _FLAGS},
        extra={k: v for k, v in raw.items() if k not in known})


def _draft_vocab(tensors: dict[str, torch.Tensor], config: Eagle3Config, where: Path) -> torch.Tensor | None:
    """Target ids of the draft columns from d2t (offsets: column j = token j + d2t[j]), checked against
    t2d and the verifier's vocabulary; None when the head drafts over the whole vocabulary."""
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    n, vocab = config.draft_vocab_size, config.vocab_size
    if n == vocab and d2t is None:
        return None
    if d2t is None:
        raise ValueError(f"{where}: draft_vocab_size {n} < vocabulary {vocab} but the weights hold no d2t map")
    if d2t.shape != (n,):
        raise ValueError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({n},) = draft_vocab_size")
    ids = torch.arange(n) + d2t.long()
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise ValueError(f"{where}: d2t maps draft columns to target ids {bad[:5].tolist()} outside the verifier's "
                         f"vocabulary [0, {vocab})")
    if ids.unique().numel() != n:
        raise ValueError(f"{where}: d2t maps two draft columns to the same target token")
    if t2d is not None:
        if t2d.shape != (vocab,):
            raise ValueError(f"{where}: t2d has {t2d.numel()} entries; the verifier's vocabulary has {vocab}")
        marked = t2d.bool().nonzero()[:, 0]
        if not torch.equal(marked, ids.sort().values):
            raise ValueError(f"{where}: t2d marks {marked.numel()} target tokens, not the {n} that d2t maps to")
    return ids


def load_speculators(directory: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """The EAGLE-3 head in a speculators checkpoint `directory` (config.json + *.safetensors), weights
    cast to `dtype`. ValueError naming the file and field for anything this head cannot run."""
    directory = Path(directory)
    if not is_speculators_dir(directory):
        raise FileNotFoundError(f"{directory} is not a directory holding config.json (a speculators checkpoint)")
    config = _read_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    vocab = _draft_vocab(tensors, config, directory)
    for name in _IGNORED:
        tensors.pop(name, None)
    embed = tensors.get("embed_tokens.weight")
    own_embed = embed is not None and not bool(embed.isnan().any())
    if not own_embed:
        tensors.pop("embed_tokens.weight", None)  # absent or never loaded: the target's embedding is used
    head = Eagle3Head(config, draft_vocab=vocab, embed=own_embed)
    expected = set(head.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match the config's EAGLE-3 head (missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]})")
    unset = [k for k, v in tensors.items() if v.is_floating_point() and bool(v.isnan().any())]
    if unset:
        raise ValueError(f"{directory}: tensors {unset[:4]} hold NaN (never loaded in training?)")
    head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    return head.to(dtype).eval()


def save_speculators(head: Eagle3Head, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                     embedding: torch.Tensor | None = None) -> Path:
    """Write `head` as a speculators checkpoint (speculators 0.9.0's config.json fields, weights in `dtype`,
    d2t/t2d for a reduced vocabulary); returns the directory. A head that reads the target's embedding
    needs it as `embedding` [V, H]: speculators would leave it uninitialised."""
    if not isinstance(head, Eagle3Head):
        raise TypeError(f"save_speculators writes EAGLE-3 heads (Eagle3Head); got {type(head).__name__}. specdec's "
                        "own EagleHead is another architecture that the speculators format cannot express "
                        "(see specdec/drafters/speculators_format.py)")
    config, directory = head.config, Path(directory)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    if "embed_tokens.weight" not in tensors:
        if embedding is None or embedding.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(f"this head reads its target's embedding: pass it as embedding "
                             f"[{config.vocab_size}, {config.hidden_size}], got "
                             f"{None if embedding is None else tuple(embedding.shape)}")
        tensors["embed_tokens.weight"] = embedding.detach().to(dtype).contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    n, vocab = config.draft_vocab_size, config.vocab_size
    if n != vocab:
        ids = head.draft_vocab.cpu()
        tensors["d2t"] = (ids - torch.arange(n)).contiguous()
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    raw = {
        **config.extra,
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "dtype": str(dtype).removeprefix("torch."),
        "draft_vocab_size": n,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "target_hidden_size": None,
        **{flag: getattr(config, flag) for flag in _FLAGS},
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": config.target_name or None,
                         "architectures": list(config.verifier_architectures)},
        },
        "transformer_layer_config": {**config.layer_config, "model_type": "llama"},
    }
    raw.pop("auto_map", None)  # the package resolves the class from speculators_model_type, not remote code
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return directory


def export_speculators(head_dir: str | Path, target, out: str | Path, dtype: torch.dtype = torch.bfloat16,
                       verifier: str | None = None, check: bool = False) -> dict:
    """Write the EAGLE-3 head of speculators directory `head_dir` (checked against `target`) to `out` in `dtype`
    with the target's embedding and `verifier`, read it back, and with `check` parse it with the package.
    Returns {out, dtype, draft_vocab, aux_layers, verifier} (+ `package_check`'s)."""
    if not is_speculators_dir(head_dir):
        raise ValueError(f"{head_dir} is not a speculators EAGLE-3 directory. A specdec head (fc over [embedding, "
                         "final feature] + a plain decoder layer, scored by the target's lm_head) is another "
                         "architecture than EAGLE-3 (the embedding never enters the residual stream, the head owns "
                         "its lm_head): the format cannot hold it, and converting means training an EAGLE-3 head")
    head = load_speculators(head_dir)
    head.config.check_target(target)
    if verifier:
        head.config = replace(head.config, target_name=verifier)
    out = save_speculators(head, out, dtype=dtype, embedding=target.base.get_input_embeddings().weight)
    again = load_speculators(out)  # the written directory reads back as the same head (up to the dtype)
    report = {"out": str(out), "dtype": str(dtype).removeprefix("torch."), "verifier": again.config.target_name,
              "draft_vocab": int(again.draft_vocab.numel()), "aux_layers": list(again.config.aux_layers)}
    return {**report, **package_check(out)} if check else report


def package_check(directory: str | Path) -> dict:
    """{package_class, tensors}: `directory` parsed by the `speculators` package (ValueError: other tensors)."""
    from safetensors import safe_open
    from speculators import SpeculatorModel, SpeculatorModelConfig

    directory = Path(directory)
    config = SpeculatorModelConfig.from_pretrained(str(directory))
    model_class = SpeculatorModel.registered_model_class_from_config(config)
    expected = {k: tuple(v.shape) for k, v in model_class(config).state_dict().items()
                if not k.startswith(("verifier_", "input_norm"))}
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if stored != {k: v for k, v in expected.items() if k in stored} or set(expected) - set(stored):
        raise ValueError(f"speculators builds tensors {sorted(set(expected) ^ set(stored))} or other shapes than "
                         f"{directory / 'model.safetensors'} holds")
    return {"package_class": model_class.__name__, "tensors": len(stored)}
