"""Roll out training prompts with a target into a token-shard rollout set (resumable; append-only).

    # every natural-* prompt, greedy, 192 new tokens, into the repository's set (rerun to resume)
    nice -n 19 python scripts/eagle_rollouts.py --out data/eagle/smollm2-135m/greedy-192 --minutes 85
    # a sampled continuation per prompt, its own set
    nice -n 19 python scripts/eagle_rollouts.py --temperature 0.7 --seed 1 --out data/eagle/smollm2-135m/t0.7-s1-192

The prompts are `specdec.training.prompts.collect` of the named sources (interleaved, deduplicated),
checked against every evaluation suite (experiments/prompts/*.jsonl). The set (specdec/training/tokens.py)
records which prompts are done, so a rerun with the same or a longer prompt list continues where the
last one stopped; another target or other rollout settings in the same folder is an error naming the
manifest. Prints one JSON line per shard and a summary line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec.machine import device_label, machine_name  # noqa: E402
from specdec.training.prompts import SOURCES, check_disjoint  # noqa: E402
from specdec.training.tokens import (TokenSet, fill_token_set, rollout_settings, source_prompts,  # noqa: E402
                                     target_identity)

NATURAL = sorted(name for name in SOURCES if name.startswith("natural-"))


def eval_texts() -> list[str]:
    """Every turn of every evaluation suite (experiments/prompts/*.jsonl)."""
    suites = sorted((ROOT / "experiments" / "prompts").glob("*.jsonl"))
    if not suites:
        raise FileNotFoundError(f"no evaluation suites under {ROOT / 'experiments' / 'prompts'}")
    return [turn for f in suites for line in f.read_text().splitlines() if line.strip()
            for turn in json.loads(line)["turns"]]


def sourced_prompts(sources: list[str], seed: int) -> list[tuple[str, tuple]]:
    """(source name, prompt) for every prompt of `sources`, checked against the evaluation suites."""
    prompts = source_prompts(sources, seed)
    check_disjoint([p for _, p in prompts], [({"content": t},) for t in eval_texts()], what="evaluation suites")
    return prompts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
           "threads": args.threads, "kernel": target.kernel,
           "batch_size": args.batch_size, "shard_prompts": args.shard_prompts, "nice": os.nice(0),
           "torch": torch.__version__}
    before = tset.num_tokens
    written = fill_token_set(target, tset, prompts, shard_prompts=args.shard_prompts, batch_size=args.batch_size,
                             deadline=started + 60 * args.minutes, max_shards=args.max_shards, run=run,
                             log=lambda s: print(s, flush=True))
    summary = {"set": str(args.out), "shards_written": written, "tokens_written": tset.num_tokens - before,
               "set_tokens": tset.num_tokens, "prompts_done": len(tset.done()), "prompts_listed": len(prompts),
               "minutes": round((time.time() - started) / 60, 1)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
