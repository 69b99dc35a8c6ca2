"""The `gpu` command of `python -m specdec.training`: on a lent CUDA machine, continue the one EAGLE run within a
wall-time budget: roll out what the first set lacks (until --rollout-share of it), then resume the run with `--grow`
(with --probe-steps, first fitting the schedule to the budget). A failed stage 1 is reported; stage 2 still runs.

    python -m specdec.training gpu --minutes 8 --probe-steps 300   # CUDA (scripts/device_train.sh)
    python -m specdec.training gpu --smoke --work W --sources S    # CPU: tiny target (the tests')
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from specdec.machine import device_label
from specdec.training import cli

SET = "data/eagle/smollm2-135m/greedy-192"
AUX_LAYERS = ("3", "15")  # the run's; a resume with others is refused by the run itself
MARGIN_MINUTES = 0.4  # Kept back for the run's last checkpoint and the compact state.
SMOKE_TRAIN = ["--num-validation", "4", "--val-every", "2", "--batch-size", "2", "--max-len", "32", "--ttt-depth", "2",
               "--warmup-steps", "1", "--ce-vocab", "64", "--eval-vocab", "64", "--draft-vocab-size", "64"]
"""Training settings of the smoke run (tiny-llama, a CPU, seconds)."""


def rollout_argv(args, minutes: float) -> list[str]:
    argv = ["--target", args.target, "--out", args.sets[0], "--device", args.device, "--batch-size", str(args.gen_batch),
            "--shard-prompts", str(args.shard_prompts), "--minutes", f"{minutes:.3f}", "--threads", str(args.threads)]
    if args.sources:
        argv += ["--sources", *args.sources]
    if args.smoke:
        argv += ["--max-new-tokens", "8", "--max-shards", "2"]
    return argv


def train_argv(args, minutes: float, resume: bool) -> list[str]:
    argv = ["--target", args.target, "--sets", *args.sets, "--out", args.out, "--curve", args.curve, "--keep", args.keep,
            "--feature-cache", args.feature_cache, "--resident-shards", str(args.resident_shards), "--device",
            args.device, "--threads", str(args.threads), "--steps", str(args.steps), "--minutes", f"{minutes:.3f}",
            "--val-every", str(args.val_every), "--anneal-start", str(args.anneal_start), "--max-steps", str(args.max_steps)]
    argv += ["--aux-layers", "1"] + SMOKE_TRAIN if args.smoke else ["--aux-layers", *AUX_LAYERS]
    return argv + (["--resume", "--grow"] if resume else ["--init-head", args.init_head] if args.init_head else [])


def fitted_schedule(probe: dict, args, started: float) -> tuple[int, int]:
    """(max_steps, anneal_start) that end the run inside the budget at the probe's rate, the last `anneal_share`
    of the steps annealing."""
    rate = probe["steps_done"] / max(probe["train_seconds"], 1e-9)
    left = 60 * (args.minutes - MARGIN_MINUTES) - (time.time() - started) - probe["setup_seconds"]
    steps = max(int(rate * left), 2)
    return probe["step"] + steps, probe["step"] + max(int((1 - args.anneal_share) * steps), 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specdec.training gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-time budget of the whole call")
    ap.add_argument("--rollout-share", type=float, default=0.3, help="stage 1 starts no batch after this share")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--sets", nargs="+", default=[SET], help="the run's rollout sets; stage 1 grows the first")
    ap.add_argument("--sources", nargs="*", default=[], help="stage 1's prompt sources (default: rollout's)")
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--shard-prompts", type=int, default=256)
    ap.add_argument("--out", default="outputs/eagle-run")
    ap.add_argument("--curve", default="data/eagle/curve.jsonl")
    ap.add_argument("--keep", default="data/eagle/run-state.pt")
    ap.add_argument("--feature-cache", default="outputs/eagle-features")
    ap.add_argument("--resident-shards", type=int, default=100_000, help="a GPU machine holds every shard's features")
    ap.add_argument("--steps", type=int, default=100_000, help="most steps this call (the budget usually ends it)")
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--anneal-start", type=int, default=10_000, help="the run's schedule (may change before it)")
    ap.add_argument("--max-steps", type=int, default=12_000)
    ap.add_argument("--probe-steps", type=int, default=0, help="with > 0: train this many steps on the given "
                    "schedule, then end the run inside the budget: the steps the rest of it allows at the measured "
                    "rate, the last --anneal-share of them annealing (allowed while the run is before anneal_start)")
    ap.add_argument("--anneal-share", type=float, default=0.4)
    ap.add_argument("--init-head", default="", help="start a new run from this head (give it its own --out, "
                    "--curve and --keep): for a run that has ended; refused where --keep or --out holds a run")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny-llama on the CPU under --work (tests)")
    ap.add_argument("--work", default="", help="with --smoke: the folder for its set, run, curve and state")
    args = ap.parse_args(argv)
    started = time.time()
    if args.smoke:
        work = Path(args.work or "outputs/train-gpu-smoke")
        args.device, args.target, args.threads, args.gen_batch, args.shard_prompts = "cpu", "tiny-llama", 1, 8, 16
        args.sets, args.out, args.curve = [str(work / "set")], str(work / "run"), str(work / "curve.jsonl")
        args.keep, args.feature_cache = str(work / "run-state.pt"), str(work / "features")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu: no CUDA device here: run it on a CUDA machine (scripts/device_train.sh), or "
                         "--smoke for the CPU test; on a CPU, `python -m specdec.training run` continues the same run")
    resume = Path(args.keep).exists() or (Path(args.out) / "run.pt").exists()
    if resume and args.init_head:
        raise SystemExit(f"gpu: --init-head starts a new run, but {args.keep} or {args.out}/run.pt holds one: "
                         "give the new run its own --out, --curve and --keep")
    if not (resume or args.init_head or args.smoke):
        raise SystemExit(f"gpu: no run state at {args.keep} or {args.out}/run.pt to continue: carry it "
                         "(scripts/device_train.sh), or start a new run with --init-head")
    summary: dict = {"device": device_label(args.device)}
    try:
        summary["rollouts"] = cli.rollout(rollout_argv(args, args.rollout_share * args.minutes))
    except Exception as err:  # noqa: BLE001 - the run still trains on the shards there are
        traceback.print_exc()
        summary["rollouts"] = {"error": f"{type(err).__name__}: {err}"}
    left = args.minutes - (time.time() - started) / 60 - MARGIN_MINUTES
    if args.probe_steps > 0:
        probe_args = argparse.Namespace(**{**vars(args), "steps": args.probe_steps})
        summary["probe"] = probe = cli.run(train_argv(probe_args, max(left, 0.05), resume))
        if probe["steps_done"] < args.probe_steps:  # the budget ended inside the probe
            summary["minutes"] = round((time.time() - started) / 60, 2)
            print(json.dumps(summary), flush=True)
            return summary
        args.max_steps, args.anneal_start = fitted_schedule(probe, args, started)
        summary["schedule"] = {"anneal_start": args.anneal_start, "max_steps": args.max_steps}
        resume, left = True, args.minutes - (time.time() - started) / 60 - MARGIN_MINUTES
    summary["train"] = cli.run(train_argv(args, max(left, 0.05), resume))
    summary["minutes"] = round((time.time() - started) / 60, 2)
    print(json.dumps(summary), flush=True)
    return summary

