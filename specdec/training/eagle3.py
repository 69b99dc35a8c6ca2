"""Training an EAGLE-3 head (specdec/drafters/speculators_format.py) on a target's features: `new_eagle3_head`,
`eagle3_loss` (cross-entropy per unrolled depth over the draft vocabulary), `train_step`, `eagle3_acceptance` and
`main` (the `eagle3` command). Knows nothing about files, schedules or where features come from.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters.eagle_head import HeadConfig, rank_vocabulary
from specdec.drafters.speculators_format import Eagle3Config, Eagle3Head, save_speculators
from specdec.training.eagle import TrainBatch, chain_acceptance, depth_targets, make_batch, unroll
from specdec.training.features import frozen_target, split_rows, token_features, token_sequences
from specdec.training.run import validation_prompts
from specdec.training.tokens import TokenSet, target_identity


def new_eagle3_head(target, aux_layers: tuple[int, ...], draft_vocab: torch.Tensor, *, layers: int = 1,
                    seed: int = 0) -> Eagle3Head:
    """A fresh float32 EAGLE-3 head for `target`: `layers` Llama decoder layers of its geometry, fc over
    `aux_layers`, lm_head rows = the target's rows of `draft_vocab`."""
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
    """Per depth s: (h_{j+s} [B, n, H], counted [B, n] bool): the pair exists and t_{j+s+1} is the target's continuation
    (prompt tokens are never drafted)."""
    return [(true, valid & F.pad(batch.generated[:, s + 1:], (0, s)))
            for s, (true, valid) in enumerate(depth_targets(batch, depth), start=1)]


def eagle3_loss(head: Eagle3Head, predicted: list[torch.Tensor], batch: TrainBatch, rows: torch.Tensor, *,
                softcap: float | None = None, depth_decay: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over depths s (weight depth_decay**(s-1)) of CE(target's probs, head's probs) over the draft
    vocabulary at counted positions, each depth divided by the counted depth-1 positions; the target's
    logits are h_{j+s} @ `rows`.T (soft-capped with `softcap`). Stats: `top1@s`."""
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
    """Greedy chain acceptance on target sequences, drafting as the eagle drafter does: `acc@s` = P(depth s right |
    depths 1..s-1 right) and `chain_mal` = 1 + sum_s P(depths 1..s right), over pairs with a greedy continuation."""
    head.eval()
    return chain_acceptance(head, embed, batches, depth,
                            lambda pred: head.draft_vocab[head.lm_head(head.logit_features(pred)).argmax(-1)])


COMMAND = """Train an EAGLE-3 head (the speculators architecture) on token-shard rollouts; save the best in that format.

    nice -n 19 python -m specdec.training eagle3 --sets data/eagle/smollm2-135m/greedy-192 --aux-layers 3 15 \\
        --out outputs/eagle3-head --minutes 35

A new head (`new_eagle3_head`) trained with EAGLE-3's loss (`eagle3_loss`, over a --depth
training-time-test unroll) by AdamW: a linear warm-up of --warmup-steps, then a cosine decay to
--final-lr-fraction over the --minutes budget (by elapsed time, so a budgeted run ends annealed however
fast the machine steps). Aux layers: vLLM's usual choice for EAGLE-3 is a low, a middle and a high layer
([2, L // 2, L - 3]); this CPU run defaults to (3, 15), whose features the specdec EAGLE run already
cached in --feature-cache. Validation: the --num-validation prompts chosen by id as the `run` command
chooses them (same seed, same prompts), their sequences and training prompts sharing an 8-word run with
them left out of training; greedy chain(--depth) acceptance every --val-every steps. `--out` receives
the best head by validation chain MAL (save_speculators, float32, with the target's embedding, so the
speculators package can load it) and `--out/curve.json` (every validation point and the run's summary).
Prints one JSON line."""


def budget_lr_factor(step: int, elapsed: float, budget: float, warmup: int, final: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from 1 to `final` as `elapsed` reaches `budget`
    (seconds). Example warmup 10, final 0.1: step 4 -> 0.5; past warm-up at half the budget -> 0.55."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(max(elapsed / budget, 0.0), 1.0)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specdec.training eagle3", description=COMMAND.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sets", nargs="+", default=["data/eagle/smollm2-135m/greedy-192"])
    ap.add_argument("--feature-cache", default="outputs/eagle-features")
    ap.add_argument("--resident-shards", type=int, default=16)
    ap.add_argument("--aux-layers", type=int, nargs="+", default=[3, 15])
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--out", default="outputs/eagle3-head")
    ap.add_argument("--minutes", type=float, default=35.0, help="training budget (validation included)")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--depth", type=int, default=4, help="training-time-test depth (and validation's chain depth)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--final-lr-fraction", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.0, help="uniform noise width on the depth-1 features")
    ap.add_argument("--num-validation", type=int, default=32)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    return ap


def main(argv: list[str] | None = None) -> dict:
    """The `eagle3` command (COMMAND); returns and prints its summary."""
    args = parser().parse_args(argv)
    started, budget = time.time(), 60 * args.minutes
    target = frozen_target(args.target, "cpu", args.threads)
    identity = target_identity(target)
    sets = [TokenSet(path, identity, TokenSet.open(path).rollout) for path in args.sets]
    seqs = token_sequences(sets)
    held = set(validation_prompts([s.prompt_id for s in seqs], [s.temperature for s in seqs], args.num_validation,
                                  args.seed))
    train_rows, val_rows, near = split_rows(seqs, held, sets)
    vocab = rank_vocabulary(torch.cat([seqs[i].tokens for i in train_rows]), target.vocab_size)
    head = new_eagle3_head(target, tuple(args.aux_layers), vocab[: args.draft_vocab_size], seed=args.seed)
    data = token_features(target, sets, tuple(args.aux_layers), args.feature_cache, identity, args.resident_shards)
    val_batches = [make_batch(data, val_rows[i:i + args.batch_size], args.max_len, target.device)
                   for i in range(0, len(val_rows), args.batch_size)]
    embed, rows = target.base.get_input_embeddings(), teacher_rows(target, head)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    curve, best, order, window = [], [None], [], []

    def validate(step: int) -> None:
        val = eagle3_acceptance(head, embed, val_batches, args.depth)
        point = {"step": step, "minutes": round((time.time() - started) / 60, 2), **val,
                 **({k: sum(w[k] for w in window) / len(window) for k in window[0]} if window else {})}
        window.clear()
        curve.append(point)
        print(json.dumps(point), flush=True)
        if best[0] is None or val["chain_mal"] > best[0]["chain_mal"]:
            best[0] = point
            save_speculators(head, out, dtype=torch.float32, embedding=embed.weight)

    validate(0)
    step = 0
    while step < args.max_steps and time.time() - started < budget:
        if not order:
            order = [train_rows[i] for i in torch.randperm(len(train_rows), generator=generator).tolist()]
        batch_rows, order = order[: args.batch_size], order[args.batch_size:]
        for group in opt.param_groups:
            group["lr"] = args.lr * budget_lr_factor(step, time.time() - started, budget, args.warmup_steps,
                                                     args.final_lr_fraction)
        batch = make_batch(data, batch_rows, args.max_len, target.device)
        window.append(train_step(head, embed, batch, opt, rows, depth=args.depth, softcap=target.softcap,
                                 noise=args.noise, generator=generator))
        step += 1
        if step % args.val_every == 0:
            validate(step)
    if not curve or curve[-1]["step"] != step:
        validate(step)
    summary = {"steps": step, "minutes": round((time.time() - started) / 60, 1), "best": best[0],
               "train_sequences": len(train_rows), "val_sequences": len(val_rows), "dropped_near_val": len(near),
               "aux_layers": args.aux_layers, "draft_vocab": args.draft_vocab_size, "depth": args.depth,
               "batch_size": args.batch_size, "max_len": args.max_len, "lr": args.lr, "out": str(out)}
    (out / "curve.json").write_text(json.dumps({"summary": summary, "curve": curve}, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return summary
