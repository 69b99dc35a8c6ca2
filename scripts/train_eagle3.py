"""Train an EAGLE-3 head (the speculators architecture) on token-shard rollouts; save the best as a speculators directory.

    nice -n 19 python scripts/train_eagle3.py --sets data/eagle/smollm2-135m/greedy-192 --aux-layers 3 15 \\
        --out outputs/eagle3-head --minutes 35

A new head (specdec/training/eagle3.py: one Llama decoder layer of the target's geometry, fc over the
aux layers, its own lm_head over the --draft-vocab-size most frequent training tokens, rows from the
target's lm_head) trained with EAGLE-3's loss (cross-entropy against the target's distribution on the
draft vocabulary, over a --depth training-time-test unroll; no feature regression) by AdamW: a linear
warm-up of --warmup-steps, then a cosine decay to --final-lr-fraction over the --minutes budget (by
elapsed time, so a budgeted run ends annealed however fast the machine steps).

Aux layers: vLLM's usual choice for EAGLE-3 is a low, a middle and a high layer ([2, L // 2, L - 3]);
this CPU run defaults to (3, 15), whose features the specdec EAGLE run already cached in
--feature-cache (features of other layers are recomputed from the tokens there first, at CPU cost).
Validation: the --num-validation prompts chosen by id as scripts/train_eagle_run.py chooses them
(`validation_prompts`, same seed, same prompts), their sequences and training prompts sharing an
8-word run with them left out of training; greedy chain(--depth) acceptance every --val-every steps.
`--out` receives the best head by validation chain MAL (save_speculators, float32, with the target's
embedding, so the speculators package can load it) and `--out/curve.json` (every validation point and
the run's summary). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec.drafters.eagle_head import rank_vocabulary  # noqa: E402
from specdec.drafters.speculators_format import save_speculators  # noqa: E402
from specdec.training.eagle import make_batch  # noqa: E402
from specdec.training.eagle3 import eagle3_acceptance, new_eagle3_head, teacher_rows, train_step  # noqa: E402
from specdec.training.features import token_features, token_sequences  # noqa: E402
from specdec.training.run import validation_prompts  # noqa: E402
from specdec.training.tokens import TokenSet, target_identity  # noqa: E402
from train_eagle_run import overlapping  # noqa: E402


def lr_factor(step: int, elapsed: float, budget: float, warmup: int, final: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from 1 to `final` as `elapsed` reaches `budget`
    (seconds). Example warmup 10, final 0.1: step 4 -> 0.5; past warm-up at half the budget -> 0.55."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(max(elapsed / budget, 0.0), 1.0)
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = ap.parse_args(argv)
    started = time.time()
    budget = 60 * args.minutes
    torch.set_num_threads(args.threads)
    target = specdec.load_target(args.target, kernel="torch", threads=args.threads)
    for p in target.model.parameters():
        p.requires_grad_(False)
    identity = target_identity(target)
    sets = [TokenSet(path, identity, TokenSet.open(path).rollout) for path in args.sets]
    seqs = token_sequences(sets)
    held = set(validation_prompts([s.prompt_id for s in seqs], [s.temperature for s in seqs], args.num_validation,
                                  args.seed))
    near = overlapping(seqs, held, sets)
    train_rows = [i for i, s in enumerate(seqs) if s.prompt_id not in held and s.prompt_id not in near]
    val_rows = [i for i, s in enumerate(seqs) if s.prompt_id in held and s.temperature == 0]
    vocab = rank_vocabulary(torch.cat([seqs[i].tokens for i in train_rows]), target.vocab_size)
    head = new_eagle3_head(target, tuple(args.aux_layers), vocab[: args.draft_vocab_size], seed=args.seed)
    data = token_features(target, sets, tuple(args.aux_layers), args.feature_cache, identity, args.resident_shards)
    val_batches = [make_batch(data, val_rows[i:i + args.batch_size], args.max_len, target.device)
                   for i in range(0, len(val_rows), args.batch_size)]
    embed, rows = target.base.get_input_embeddings(), teacher_rows(target, head)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    curve, best, order, window = [], None, [], []

    def validate(step: int) -> None:
        nonlocal best
        val = eagle3_acceptance(head, embed, val_batches, args.depth)
        point = {"step": step, "minutes": round((time.time() - started) / 60, 2), **val,
                 **({k: sum(w[k] for w in window) / len(window) for k in window[0]} if window else {})}
        window.clear()
        curve.append(point)
        print(json.dumps(point), flush=True)
        if best is None or val["chain_mal"] > best["chain_mal"]:
            best = point
            save_speculators(head, out, dtype=torch.float32, embedding=embed.weight)

    validate(0)
    step = 0
    while step < args.max_steps and time.time() - started < budget:
        if not order:
            order = [train_rows[i] for i in torch.randperm(len(train_rows), generator=generator).tolist()]
        batch_rows, order = order[: args.batch_size], order[args.batch_size:]
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step, time.time() - started, budget, args.warmup_steps,
                                              args.final_lr_fraction)
        batch = make_batch(data, batch_rows, args.max_len, target.device)
        window.append(train_step(head, embed, batch, opt, rows, depth=args.depth, softcap=target.softcap,
                                 noise=args.noise, generator=generator))
        step += 1
        if step % args.val_every == 0:
            validate(step)
    if not curve or curve[-1]["step"] != step:
        validate(step)
    summary = {"steps": step, "minutes": round((time.time() - started) / 60, 1), "best": best,
               "train_sequences": len(train_rows), "val_sequences": len(val_rows), "dropped_near_val": len(near),
               "aux_layers": args.aux_layers, "draft_vocab": args.draft_vocab_size, "depth": args.depth,
               "batch_size": args.batch_size, "max_len": args.max_len, "lr": args.lr, "out": str(out)}
    (out / "curve.json").write_text(json.dumps({"summary": summary, "curve": curve}, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
