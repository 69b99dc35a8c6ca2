"""The `rollout` and `run` commands of `python -m specdec.training`: grow a rollout set, advance the one EAGLE run.

    nice -n 19 python -m specdec.training rollout --out data/eagle/smollm2-135m/greedy-192 --minutes 85
    nice -n 19 python -m specdec.training run --sets data/eagle/smollm2-135m/greedy-192 --aux-layers 3 15 --resume

`rollout` continues a set (its prompts checked against every evaluation suite); `run` keeps its validation prompts in
the checkpoint, needs --grow for sets that gained shards and --resume for an existing checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import specdec
from specdec.drafters.eagle_head import EagleHead, HeadConfig, rank_vocabulary, widen
from specdec.machine import device_label, machine_name
from specdec.training.eagle import make_batch
from specdec.training.features import frozen_target, split_rows, token_features, token_sequences
from specdec.training.prompts import SOURCES, check_disjoint
from specdec.training.run import Run, RunConfig, advance, append_curve, trim_curve, validation_prompts
from specdec.training.tokens import (TokenSet, fill_token_set, rollout_settings, set_checksum, source_prompts,
                                     target_identity)

ROOT = Path(__file__).resolve().parents[2]
EVAL_SUITES = ROOT / "experiments" / "prompts"
NATURAL = sorted(name for name in SOURCES if name.startswith("natural-"))
KEEP = "data/eagle/run-state.pt"
RUN_SETTINGS = ("lr", "warmup_steps", "anneal_start", "max_steps", "batch_size", "max_len", "ttt_depth", "ce_vocab",
                "eval_vocab", "val_depth", "seed", "val_dtype", "ce_weight")  # RunConfig fields that `run` takes


def sourced_prompts(sources: list[str], seed: int) -> list[tuple[str, tuple]]:
    """(source name, prompt) for every prompt of `sources`, checked against every turn of every
    evaluation suite (experiments/prompts/*.jsonl)."""
    suites = sorted(EVAL_SUITES.glob("*.jsonl"))
    if not suites:
        raise FileNotFoundError(f"no evaluation suites under {EVAL_SUITES}")
    turns = [t for f in suites for line in f.read_text().splitlines() if line.strip()
             for t in json.loads(line)["turns"]]
    prompts = source_prompts(sources, seed)
    check_disjoint([p for _, p in prompts], [({"content": t},) for t in turns], what="evaluation suites")
    return prompts


def rollout(argv: list[str] | None = None) -> dict:
    """Roll out training prompts with a target into a token-shard rollout set (resumable; append-only)."""
    ap = argparse.ArgumentParser(prog="python -m specdec.training rollout", description=rollout.__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sources", nargs="+", default=NATURAL, help="prompt source names (default: every natural-*)")
    ap.add_argument("--out", required=True, help="the rollout set folder, e.g. data/eagle/smollm2-135m/greedy-192")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0, help="prompt order and, when sampled, the sampling seed")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--shard-prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:n] (the run records which)")
    ap.add_argument("--minutes", type=float, default=60.0, help="start no batch after this many minutes")
    ap.add_argument("--max-shards", type=int, default=None)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.sources) - set(SOURCES))
    if unknown:
        raise SystemExit(f"unknown prompt sources {unknown}; known: {sorted(SOURCES)}")
    started = time.time()
    torch.set_num_threads(args.threads)
    target = specdec.load_target(args.target, device=args.device, kernel="torch", threads=args.threads)
    prompts = sourced_prompts(args.sources, args.seed)
    tset = TokenSet(args.out, target_identity(target),
                    rollout_settings(temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens),
                    prompts={"sources": args.sources, "order": "specdec.training.prompts.collect(all of each, seed)",
                             "seed": args.seed, "id": "specdec.training.tokens.prompt_id: sha256(turns JSON)[:16]"})
    run = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "started_unix": started, "sources": args.sources,
           "prompts_listed": len(prompts), "cpu": machine_name(), "device": device_label(target.device),
           "threads": args.threads, "kernel": target.kernel, "batch_size": args.batch_size,
           "shard_prompts": args.shard_prompts, "nice": os.nice(0), "torch": torch.__version__}
    before = tset.num_tokens
    written = fill_token_set(target, tset, prompts, shard_prompts=args.shard_prompts, batch_size=args.batch_size,
                             deadline=started + 60 * args.minutes, max_shards=args.max_shards, run=run,
                             log=lambda s: print(s, flush=True))
    summary = {"set": str(args.out), "shards_written": written, "tokens_written": tset.num_tokens - before,
               "set_tokens": tset.num_tokens, "prompts_done": len(tset.done()), "prompts_listed": len(prompts),
               "minutes": round((time.time() - started) / 60, 1)}
    print(json.dumps(summary), flush=True)
    return summary


def run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specdec.training run",
                                 description="Advance the one EAGLE training run on token-shard rollout sets.")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sets", nargs="+", required=True, help="rollout set folders (data/eagle/...)")
    ap.add_argument("--out", default="outputs/eagle-run", help="checkpoint folder (run.pt, head-best)")
    ap.add_argument("--curve", default="data/eagle/curve.jsonl")
    ap.add_argument("--keep", default=None, help="the compact run state kept in the "
                    "repository, written when the session ends; --resume starts from it when --out has no "
                    f"later state (another machine); empty = none; default {KEEP}, none with --fork")
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
    for name in RUN_SETTINGS:
        default = getattr(defaults, name)
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return ap


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
    rest = head.draft_vocab[~torch.isin(head.draft_vocab, vocab)]
    head.draft_vocab = torch.cat([vocab, rest])[: args.draft_vocab_size]
    return head


def open_run(args, target, sets: list[TokenSet], seqs, checkpoint: Path, keep: Path | None) -> Run:
    """The run `args` asks for: forked from --fork, resumed (from --out's state or --keep, whichever is
    later) or new; SystemExit where that would start over a run or fork onto one."""
    cfg = RunConfig(**{f: getattr(args, f) for f in RUN_SETTINGS})
    expected = HeadConfig.for_target(target, aux_layers=tuple(args.aux_layers))
    checksum, shards = set_checksum(sets), [[info.sha256 for info in s.shards] for s in sets]
    if checkpoint.exists() and not args.resume and not args.fork:
        raise SystemExit(f"{checkpoint} exists: pass --resume to continue that run, or another --out to start one")
    if args.fork:
        if args.resume or checkpoint.exists():
            raise SystemExit(f"--fork starts a new run: give it an --out without a run.pt (not {checkpoint}), "
                             "no --resume")
        run = Run.resume(args.fork, target, cfg, checksum, expected, shards, grow=args.grow, fork=True)
        run.best = None  # the fork's best is its own
        return run
    if args.resume:
        kept_step = Run.saved_step(keep) if keep is not None else -1
        start = keep if kept_step > Run.saved_step(checkpoint) else checkpoint
        if start == keep:
            print(f"resuming from {keep} (step {kept_step}): {checkpoint} is older or absent", flush=True)
        run = Run.resume(start, target, cfg, checksum, expected, shards, grow=args.grow)
        trim_curve(args.curve, run.step)
        return run
    val_ids = validation_prompts([s.prompt_id for s in seqs], [s.temperature for s in seqs], args.num_validation,
                                 args.seed)
    torch.manual_seed(args.seed)
    head = new_head(args, target, torch.cat([s.tokens for s in seqs if s.prompt_id not in set(val_ids)]), expected)
    return Run(cfg, head, target, checksum, val_ids, shards)


def run(argv: list[str] | None = None) -> dict:
    """Advance the one EAGLE training run (module docstring); returns and prints its summary."""
    args = run_parser().parse_args(argv)
    started = time.time()
    target = frozen_target(args.target, args.device, args.threads)
    identity = target_identity(target)
    sets = [TokenSet(path, identity, TokenSet.open(path).rollout) for path in args.sets]
    out, seqs = Path(args.out), token_sequences(sets)
    out.mkdir(parents=True, exist_ok=True)
    if args.keep is None:  # a fork keeps no compact state unless told where: never over the run it forks
        args.keep = "" if args.fork else KEEP
    keep = Path(args.keep) if args.keep else None
    run = open_run(args, target, sets, seqs, out / "run.pt", keep)
    data = token_features(target, sets, tuple(args.aux_layers), args.feature_cache, identity, args.resident_shards)
    train_rows, val_rows, near = split_rows(seqs, set(run.val_ids), sets)
    size = run.cfg.batch_size
    val_batches = [make_batch(data, val_rows[i:i + size], run.cfg.max_len, target.device)
                   for i in range(0, len(val_rows), size)]
    if not args.resume:
        if Path(args.curve).exists() and Path(args.curve).stat().st_size:
            raise SystemExit(f"{args.curve} already holds a curve: give a new run its own --curve")
        Path(args.curve).parent.mkdir(parents=True, exist_ok=True)
        append_curve(args.curve, run.curve_point(run.validate(val_batches)))
        run.head.save(out / "head-best", dtype=torch.float32)
        run.save(out / "run.pt")
    best_step = run.best["step"] if run.best else None
    first_step, training = run.step, time.time()
    done = advance(run, data, train_rows, val_batches, until=min(run.cfg.max_steps, run.step + args.steps),
                   val_every=args.val_every, checkpoint=out / "run.pt", curve=args.curve,
                   deadline=started + 60 * args.minutes,
                   on_best=lambda r: r.head.save(out / "head-best", dtype=torch.float32))
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        run.save(keep, compact=True)
    summary = {"step": run.step, "reached": done, "best": run.best, "previous_best_step": best_step,
               "train_sequences": len(train_rows), "val_sequences": len(val_rows), "dropped_near_val": len(near),
               "data_checksum": set_checksum(sets)[:16], "minutes": round((time.time() - started) / 60, 1),
               "steps_done": run.step - first_step, "train_seconds": round(time.time() - training, 2),
               "setup_seconds": round(training - started, 2)}
    print(json.dumps(summary), flush=True)
    return summary
