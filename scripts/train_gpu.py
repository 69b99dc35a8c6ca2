"""One call, one head: self-distillation rollouts at batch 256 and EAGLE-3 training on a CUDA machine,
inside a wall-time budget; only the head and its validation curve come back.

    python scripts/train_gpu.py --out OUT                  # CUDA: the shipped recipe in --minutes 9
    python scripts/train_gpu.py --out OUT                  # again after a cut: resumes (see below)
    python scripts/train_gpu.py --smoke --out OUT          # CPU: tiny target, a few steps (the test suite's)

Runs scripts/train_eagle.py's own stages in this process, with its config and code (nothing here
trains or rolls out by itself): stage=data (the rollouts, batch `gen_batch_size`, shard by shard,
stopped at a share of the budget), then stage=train with resume=true (EAGLE's loss over the
training-time test, validation every `val_every` steps, the best head by validation chain MAL) with
what is left of the budget. Work (shards, checkpoints, logs) stays in --work; --out receives only
head.safetensors + head.json (the best head), val_curve.json (validation per depth at each validation
step) and summary.json.

Resuming: a rerun with the same --work skips the data stage once it has finished (work/data.done) and
continues training from work/last (optimizer, schedule and batch order included); a cut data stage
resumes at the first missing shard. --minutes is the budget of this call.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "specdec" / "drafters" / "heads" / "smollm2-135m.safetensors"

RECIPE = {  # the shipped head's recipe (specdec/training/LOG.md), sized for minutes on one GPU
    "target": "smollm2-135m", "device": "cuda", "threads": 4,
    "sources": "[chat:20000,stdlib:200,templates-v1:1280]", "num_validation": 128,
    "max_new_tokens": 256, "gen_batch_size": 256, "shard_prompts": 256, "sampled_fraction": 0.25,
    "aux_layers": "[3,15]", "init_head": str(SHIPPED), "ttt_depth": 4, "ce_weight": 0.1,
    "batch_size": 64, "max_len": 512, "max_steps": 3000, "val_every": 100, "lr": 5e-4, "warmup_steps": 30,
}
SMOKE = {  # the same stages on a tiny random target, seconds on a CPU
    "target": "tiny-llama", "device": "cpu", "threads": 1, "sources": "[stdlib:24]", "num_validation": 4,
    "max_new_tokens": 8, "gen_batch_size": 8, "shard_prompts": 8, "aux_layers": "[1]", "ttt_depth": 2,
    "batch_size": 4, "max_len": 64, "draft_vocab_size": 64, "ce_vocab": 64, "eval_vocab": 64, "val_depth": 3,
    "max_steps": 4, "val_every": 2, "warmup_steps": 2,
}
DATA_SHARE = 0.4
"""Share of the budget the rollouts may use (the rest trains)."""
MARGIN_MINUTES = 0.5
"""Kept back for the last validation, checkpoint and copy."""


def _train_eagle():
    """scripts/train_eagle.py as a module (scripts/ is not a package)."""
    if "train_eagle" in sys.modules:
        return sys.modules["train_eagle"]
    spec = importlib.util.spec_from_file_location("train_eagle", ROOT / "scripts" / "train_eagle.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_eagle"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_stage(module, overrides: dict) -> None:
    """train_eagle's main on its composed, strict config (Hydra's compose, no output dir of its own)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "scripts"), version_base="1.3"):
        cfg = compose("train_eagle", overrides=[f"{k}={v}" for k, v in overrides.items()])
    module.main.__wrapped__(cfg)


def validation_curve(log: Path) -> list[dict]:
    """Every validation record of train_log.jsonl (all runs of this work dir), by step, the last per step."""
    curve = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if "val" in record:
            curve[record["step"]] = {"step": record["step"], **record["val"]}
    return [curve[s] for s in sorted(curve)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Roll out and train an EAGLE head in one call (CUDA), or smoke-test.")
    parser.add_argument("--out", required=True, help="where the head, its validation curve and summary go")
    parser.add_argument("--work", default="outputs/train-gpu", help="shards and checkpoints (resume from here)")
    parser.add_argument("--minutes", type=float, default=9.0, help="wall-time budget of this call")
    parser.add_argument("--smoke", action="store_true", help="tiny target on the CPU, a few steps")
    parser.add_argument("--steps", type=int, default=None, help="max_steps (the cosine schedule's length)")
    parser.add_argument("overrides", nargs="*", help="more train_eagle.py overrides, KEY=VALUE")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    settings = dict(SMOKE if args.smoke else RECIPE)
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"override {item!r} is not KEY=VALUE")
        settings[key] = value
    if args.steps is not None:
        settings["max_steps"] = args.steps
    import torch

    if str(settings["device"]).startswith("cuda") and not torch.cuda.is_available():
        print("train_gpu: error: no CUDA device here: run it on a CUDA machine, --smoke for the CPU test, or "
              "device=cpu to run the full recipe on this CPU (many hours)", file=sys.stderr)
        return 2
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    settings.update(out_dir=str(work), data_dir=str(work / "data"))
    module = _train_eagle()
    done = work / "data.done"
    if not done.exists():
        run_stage(module, {**settings, "stage": "data", "data_max_minutes": DATA_SHARE * args.minutes})
        done.write_text(json.dumps({"minutes": (time.perf_counter() - started) / 60}) + "\n")
    left = args.minutes - (time.perf_counter() - started) / 60 - MARGIN_MINUTES
    run_stage(module, {**settings, "stage": "train", "resume": "true", "max_minutes": max(left, 0.01)})

    out.mkdir(parents=True, exist_ok=True)
    for suffix in (".safetensors", ".json"):
        shutil.copyfile(work / f"head-best{suffix}", out / f"head{suffix}")
    curve = validation_curve(work / "train_log.jsonl")
    (out / "val_curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    summary = {**json.loads((work / "summary.json").read_text()), "call_minutes": (time.perf_counter() - started) / 60,
               "device": torch.cuda.get_device_name() if settings["device"] != "cpu" else "cpu", "settings": settings}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"out": str(out), "best": summary["best"], "minutes": round(summary["call_minutes"], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
