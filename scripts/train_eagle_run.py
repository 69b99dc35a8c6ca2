"""Advance the one EAGLE training run on token-shard rollout sets (specdec/training/run.py); resumable.

    # start (or, with --resume, continue) the run; stops after --steps more steps or --minutes
    nice -n 19 python scripts/train_eagle_run.py --sets data/eagle/smollm2-135m/greedy-192 \\
        --init-head specdec/drafters/heads/smollm2-135m.safetensors --aux-layers 3 15 \\
        --out outputs/eagle-run --curve data/eagle/curve.jsonl --steps 500 --minutes 55 [--resume]

The target's features are recomputed from the tokens once per machine into --feature-cache (one file
per shard, bf16), and read from there with --resident-shards shards in memory at a time. The
validation prompts (`--num-validation`, by prompt id) are chosen when the run starts and kept in its
checkpoint; their sequences never enter training. Resuming on sets that gained shards since the
checkpoint needs --grow (recorded in the run's data_history); any other change is refused. `--out/run.pt` holds the whole run state (head,
AdamW, step, batch order, generator, the shard set's checksum); `--out/head-best.safetensors` the best
head by validation chain MAL; the curve is appended to --curve (one JSON line per validation). A
checkpoint that exists without --resume is an error (a run is continued, never restarted by accident).
When the session ends, --keep (data/eagle/run-state.pt, committed) receives the compact state
(`Run.save(compact=True)`: bf16 head and second moment, ~20 MB): on a machine without --out's state,
--resume continues from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec.drafters.eagle_head import EagleHead, HeadConfig, rank_vocabulary, widen  # noqa: E402
from specdec.training.eagle import make_batch  # noqa: E402
from specdec.training.features import token_features, token_sequences  # noqa: E402
from specdec.training.run import Run, RunConfig, advance, append_curve, trim_curve, validation_prompts  # noqa: E402
from specdec.training.prompts import prompt_text, shared_ngrams, user  # noqa: E402
from specdec.training.tokens import TokenSet, prompt_id, set_checksum, source_prompts, target_identity  # noqa: E402


KEEP = "data/eagle/run-state.pt"


def run_config(args) -> RunConfig:
    return RunConfig(lr=args.lr, warmup_steps=args.warmup_steps, anneal_start=args.anneal_start,
                     max_steps=args.max_steps, batch_size=args.batch_size, max_len=args.max_len,
                     ttt_depth=args.ttt_depth, ce_vocab=args.ce_vocab, eval_vocab=args.eval_vocab,
                     val_depth=args.val_depth, seed=args.seed, val_dtype=args.val_dtype, ce_weight=args.ce_weight)


def new_head(args, target, tokens: torch.Tensor, expected: HeadConfig) -> EagleHead:
    """The run's starting head: --init-head (widened to --aux-layers if plain) or a fresh one; its draft
    vocabulary the data's tokens by frequency, then the init head's own ranking."""
    vocab = rank_vocabulary(tokens, target.vocab_size)[: args.draft_vocab_size]
    if not args.init_head:
        return EagleHead(expected, draft_vocab=vocab)
    head = EagleHead.load(args.init_head)
    if expected.aux_layers and not head.config.aux_layers:
        head = widen(head, expected.aux_layers)
    head.config.check_same_geometry(expected, args.init_head)
    head.draft_vocab = torch.cat([vocab, head.draft_vocab[~torch.isin(head.draft_vocab, vocab)]])[: args.draft_vocab_size]
    return head


def overlapping(seqs, held: set[str], sets: list[TokenSet]) -> set[str]:
    """Ids of training prompts that share an 8-word run with a validation prompt (dropped, as
    specdec.training.prompts.split drops them), the texts found again from the sets' prompt sources;
    SystemExit naming the set when a prompt id is not among them (its source changed)."""
    texts = {}
    for s in sets:
        sources = sorted({src for info in s.shards for src in info.sources})
        texts.update((prompt_id(p), prompt_text(p)) for _, p in source_prompts(sources, s.manifest["prompts"].get("seed", 0)))
    lost = sorted({q.prompt_id for q in seqs} - set(texts))
    if lost:
        raise SystemExit(f"{len(lost)} prompt ids of {[str(s.root) for s in sets]} (e.g. {lost[0]}) are not in their "
                         "sources now: the prompt sources changed, the overlap with validation cannot be checked")
    train = sorted({q.prompt_id for q in seqs} - held)
    close = set(shared_ngrams([user(texts[i]) for i in train], [texts[i] for i in sorted(held)]))
    return {i for i in train if texts[i] in close}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sets", nargs="+", required=True, help="rollout set folders (data/eagle/...)")
    ap.add_argument("--out", default="outputs/eagle-run", help="checkpoint folder (run.pt, head-best)")
    ap.add_argument("--curve", default="data/eagle/curve.jsonl")
    ap.add_argument("--keep", default=None, help="the compact run state kept in the "
                    "repository, written when the session ends; --resume starts from it when --out has no "
                    "later state (another machine); empty = none; default data/eagle/run-state.pt, none with --fork")
    ap.add_argument("--feature-cache", default="outputs/eagle-features")
    ap.add_argument("--resident-shards", type=int, default=32, help="shards of features held in memory at once")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--grow", action="store_true", help="resume on sets that gained shards since the checkpoint")
    ap.add_argument("--fork", default="", help="start a new run (its own --out and --curve) from this saved run "
                    "state, with other training settings allowed (e.g. --ce-weight): an A/B arm at equal steps")
    ap.add_argument("--init-head", default="")
    ap.add_argument("--aux-layers", type=int, nargs="*", default=[])
    ap.add_argument("--num-validation", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100, help="steps this session (the run ends at --max-steps)")
    ap.add_argument("--minutes", type=float, default=55.0)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:n]: the run state moves between them")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    defaults = RunConfig()
    for name in ("lr", "warmup_steps", "anneal_start", "max_steps", "batch_size", "max_len", "ttt_depth",
                 "ce_vocab", "eval_vocab", "val_depth", "seed", "val_dtype", "ce_weight"):
        ap.add_argument("--" + name.replace("_", "-"), type=type(getattr(defaults, name)), default=getattr(defaults, name))
    args = ap.parse_args(argv)
    started = time.time()
    torch.set_num_threads(args.threads)
    target = specdec.load_target(args.target, device=args.device, kernel="torch", threads=args.threads)
    for p in target.model.parameters():
        p.requires_grad_(False)
    identity = target_identity(target)
    sets = [TokenSet(path, identity, TokenSet.open(path).rollout) for path in args.sets]
    checksum = set_checksum(sets)
    shards = [[info.sha256 for info in s.shards] for s in sets]
    cfg = run_config(args)
    expected = HeadConfig.for_target(target, aux_layers=tuple(args.aux_layers))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "run.pt"
    seqs = token_sequences(sets)
    if args.keep is None:  # a fork keeps no compact state unless told where: never over the run it forks
        args.keep = "" if args.fork else KEEP
    keep = Path(args.keep) if args.keep else None
    if checkpoint.exists() and not args.resume and not args.fork:
        raise SystemExit(f"{checkpoint} exists: pass --resume to continue that run, or another --out to start one")
    if args.fork:
        if args.resume or checkpoint.exists():
            raise SystemExit(f"--fork starts a new run: give it an --out without a run.pt (not {checkpoint}), no --resume")
        run = Run.resume(args.fork, target, cfg, checksum, expected, shards, grow=args.grow, fork=True)
        run.best = None  # the fork's best is its own
    elif args.resume:
        kept_step = Run.saved_step(keep) if keep is not None else -1
        start = keep if kept_step > Run.saved_step(checkpoint) else checkpoint
        if start == keep:
            print(f"resuming from {keep} (step {kept_step}): {checkpoint} is older or absent", flush=True)
        run = Run.resume(start, target, cfg, checksum, expected, shards, grow=args.grow)
        trim_curve(args.curve, run.step)
    else:
        val_ids = validation_prompts([s.prompt_id for s in seqs], [s.temperature for s in seqs], args.num_validation,
                                     args.seed)
        torch.manual_seed(args.seed)
        head = new_head(args, target, torch.cat([s.tokens for s in seqs if s.prompt_id not in set(val_ids)]), expected)
        run = Run(cfg, head, target, checksum, val_ids, shards)
    data = token_features(target, sets, tuple(args.aux_layers), args.feature_cache, identity, args.resident_shards)
    held = set(run.val_ids)
    near = overlapping(seqs, held, sets)
    train_rows = [i for i, s in enumerate(seqs) if s.prompt_id not in held and s.prompt_id not in near]
    val_rows = [i for i, s in enumerate(seqs) if s.prompt_id in held and s.temperature == 0]
    val_batches = [make_batch(data, val_rows[i:i + cfg.batch_size], cfg.max_len, target.device)
                   for i in range(0, len(val_rows), cfg.batch_size)]
    if not args.resume:
        if Path(args.curve).exists() and Path(args.curve).stat().st_size:
            raise SystemExit(f"{args.curve} already holds a curve: give a new run its own --curve")
        Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
        append_curve(args.curve, run.curve_point(run.validate(val_batches)))
        run.head.save(out / "head-best", dtype=torch.float32)
        run.save(checkpoint)
    best_step = run.best["step"] if run.best else None
    first_step, training = run.step, time.time()
    done = advance(run, data, train_rows, val_batches, until=min(cfg.max_steps, run.step + args.steps),
                   val_every=args.val_every, checkpoint=checkpoint, curve=args.curve,
                   deadline=started + 60 * args.minutes,
                   on_best=lambda r: r.head.save(out / "head-best", dtype=torch.float32))
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        run.save(keep, compact=True)
    summary = {"step": run.step, "reached": done, "best": run.best, "previous_best_step": best_step,
               "train_sequences": len(train_rows), "val_sequences": len(val_rows), "dropped_near_val": len(near), "data_checksum": checksum[:16],
               "minutes": round((time.time() - started) / 60, 1), "steps_done": run.step - first_step,
               "train_seconds": round(time.time() - training, 2), "setup_seconds": round(training - started, 2)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
