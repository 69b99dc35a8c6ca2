"""Training an EAGLE-3 head (the speculators architecture, specdec/drafters/speculators_format.py) on a target's features.

Owns `new_eagle3_head` (a fresh head for a target: one Llama decoder layer of the target's geometry,
fusing the given aux layers, its own lm_head over a draft vocabulary initialised from the target's
lm_head rows), `eagle3_loss` (EAGLE-3's objective over the training-time test unroll: per depth, the
cross-entropy of the head's draft-vocabulary logits against the target's distribution on that
vocabulary at the position the prediction stands for; no feature regression), `train_step` (one AdamW
step on a batch) and `eagle3_acceptance` (greedy chain acceptance per depth on validation batches,
drafting as the `eagle` drafter does: argmax of the head's own lm_head). Knows nothing about files,
schedules or where the features come from: `unroll`, `depth_targets` and `TrainBatch` are
specdec/training/eagle.py's, and scripts/train_eagle3.py drives a run.

Alignment is unroll's: entry j of depth s predicts the target's feature h_{j+s}, whose distribution
over the next token (softmax(h_{j+s} @ lm_head rows)) is the distribution of t_{j+s+1}. Restricted to
the draft vocabulary and renormalised there, it is the teacher the head's logits are scored against
(speculators trains against the target's logits mapped through t2d in the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.drafters.eagle_head import HeadConfig
from specdec.drafters.speculators_format import Eagle3Config, Eagle3Head
from specdec.training.eagle import TrainBatch, chain_acceptance, depth_targets, unroll


def new_eagle3_head(target, aux_layers: tuple[int, ...], draft_vocab: torch.Tensor, *, layers: int = 1,
                    seed: int = 0) -> Eagle3Head:
    """A fresh float32 EAGLE-3 head for `target`: `layers` Llama decoder layers of the target's
    geometry (heads, kv heads, head_dim, intermediate size, rope, eps), fc over `aux_layers` (HF
    hidden_states indices), lm_head rows = the target's lm_head rows of `draft_vocab` [N] (target ids)."""
    geometry = HeadConfig.for_target(target, aux_layers=tuple(aux_layers))
    geometry.check_target(target)
    text = target.model.config.get_text_config()
    layer = dict(model_type="llama", vocab_size=geometry.vocab_size, hidden_size=geometry.hidden_size,
                 intermediate_size=geometry.intermediate_size, num_hidden_layers=layers,
                 num_attention_heads=geometry.num_attention_heads, num_key_value_heads=geometry.num_key_value_heads,
                 head_dim=geometry.head_dim, rms_norm_eps=geometry.rms_norm_eps, hidden_act="silu",
                 max_position_embeddings=int(getattr(text, "max_position_embeddings", 8192)),
                 rope_parameters={"rope_type": "default", "rope_theta": geometry.rope_theta})
    draft_vocab = draft_vocab.long().cpu()
    if draft_vocab.unique().numel() != draft_vocab.numel():
        raise ValueError(f"draft_vocab holds {draft_vocab.numel() - draft_vocab.unique().numel()} repeated target ids")
    config = Eagle3Config(layer_config=layer, aux_layers=tuple(aux_layers), draft_vocab_size=draft_vocab.numel(),
                          target_name=target.name,
                          verifier_architectures=tuple(getattr(target.model.config, "architectures", None) or ()))
    torch.manual_seed(seed)
    head = Eagle3Head(config, draft_vocab=draft_vocab)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight.detach().float().cpu()[draft_vocab])
    return head.float().to(target.device)


def teacher_rows(target, head: Eagle3Head) -> torch.Tensor:
    """The target's lm_head rows of the head's draft vocabulary, [N, H] float32 (fixed during training)."""
    return target.lm_head.weight.detach().float()[head.draft_vocab.to(target.lm_head.weight.device)]


def scored_targets(batch: TrainBatch, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth s: (h_{j+s} [B, n, H], counted [B, n] bool): the pair exists (j + s < length) and the
    token its prediction stands for, t_{j+s+1}, is the target's continuation (prompt tokens are never
    drafted). E.g. prompt_len 3, s = 1: pairs j >= 1 count (t_{j+2} at index >= 3)."""
    return [(true, valid & F.pad(batch.generated[:, s + 1:], (0, s)))
            for s, (true, valid) in enumerate(depth_targets(batch, depth), start=1)]


def eagle3_loss(head: Eagle3Head, predicted: list[torch.Tensor], batch: TrainBatch, rows: torch.Tensor, *,
                softcap: float | None = None, depth_decay: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over depths s (weight depth_decay**(s-1)) of CE(target's probs, head's probs) over the draft
    vocabulary, at counted positions (`scored_targets`), each depth's sum divided by the number of
    counted depth-1 positions. The target's logits there are h_{j+s} @ `rows`.T (rows [N, H] =
    `teacher_rows`; tanh soft-capped like the target's when `softcap`); the head's are
    lm_head(logit_features(predicted[s-1])). Stats: `top1@s`, how often the head's argmax is the target's."""
    targets = scored_targets(batch, len(predicted))
    count = targets[0][1].sum().clamp(min=1)
    total = predicted[0].new_zeros((), dtype=torch.float32)
    stats: dict[str, float] = {}
    for s, (pred, (true, use)) in enumerate(zip(predicted, targets), start=1):
        with torch.no_grad():
            teacher = F.linear(true[use].float(), rows)  # [M, N]
            if softcap:
                teacher = torch.tanh(teacher / softcap) * softcap
        log_student = head.lm_head(head.logit_features(pred[use])).float().log_softmax(-1)  # [M, N]
        ce = -(teacher.softmax(-1) * log_student).sum(-1)  # [M]
        total = total + depth_decay ** (s - 1) * ce.sum() / count
        stats[f"top1@{s}"] = float((log_student.argmax(-1) == teacher.argmax(-1)).float().mean()) if use.any() else 0.0
    return total, stats


def train_step(head: Eagle3Head, embed, batch: TrainBatch, opt: torch.optim.Optimizer, rows: torch.Tensor, *,
               depth: int, softcap: float | None = None, noise: float = 0.0, grad_clip: float = 0.5,
               generator: torch.Generator | None = None) -> dict[str, float]:
    """One optimiser step of `eagle3_loss` over a depth-`depth` unroll of `batch`; returns loss and top-1 stats."""
    head.train()
    predicted = unroll(head, embed, batch, depth, noise, generator)
    loss, stats = eagle3_loss(head, predicted, batch, rows, softcap=softcap)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), grad_clip)
    opt.step()
    return {"loss": float(loss.detach()), **stats}


@torch.no_grad()
def eagle3_acceptance(head: Eagle3Head, embed, batches: list[TrainBatch], depth: int) -> dict[str, float]:
    """Greedy chain acceptance on target sequences, drafting as the eagle drafter does (draft token =
    draft_vocab[argmax lm_head(logit_features(x))]): over every pair j whose next depth + 1 tokens are
    the target's continuation, `acc@s` = P(depth s right | depths 1..s-1 right) and `chain_mal` =
    1 + sum_s P(depths 1..s right) (chain(depth)'s mean acceptance length, bonus included)."""
    head.eval()
    return chain_acceptance(head, embed, batches, depth,
                            lambda pred: head.draft_vocab[head.lm_head(head.logit_features(pred)).argmax(-1)])
