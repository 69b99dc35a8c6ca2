"""How far can KV compression go before it stops being free? The full self-draft KV-retention sweep.

    python scripts/bench_self_draft.py                                   # the full sweep (hours on a CPU)
    python scripts/bench_self_draft.py --contexts 2048 --prompts 2 --retentions 25,100 --new-tokens 16 \\
        --mal-prompts 0                                                  # a small version, minutes

The main job's reduced curve (`experiments.kv`) at full size: per context, prompt, KV policy and
retention, per-token acceptance, TV and KL along the target's greedy tokens, MAL on the first
`--mal-prompts` prompts, and per context the verdict (`experiments.kv.verdict`). Prints one line per
prompt x policy x retention, then the JSON line, recorded through `specdec.measure.records` (kind
"self_draft").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` from a source checkout

import specdec  # noqa: E402
from experiments import kv  # noqa: E402
from specdec.measure import records  # noqa: E402

POLICIES = ("window", "snapkv", "quant4", "quant8")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2048,4096,7168", help="prompt tokens at most, one sweep each")
    ap.add_argument("--prompts", type=int, default=8, help="ledger prompts per context")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--retentions", default="5,10,25,50,100", help="percent of prompt positions kept")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=12, help="chain depth of the MAL runs (the full cache reaches depth + 1)")
    ap.add_argument("--mal-prompts", type=int, default=2, help="prompts per context whose MAL is measured")
    ap.add_argument("--bootstrap", type=int, default=2000)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    started = time.perf_counter()
    target = specdec.load_target(args.model)
    policies = [p for p in args.policies.split(",") if p]
    retentions = [float(r) / 100 for r in args.retentions.split(",")]
    rows, verdicts = [], {}
    for context in (int(c) for c in args.contexts.split(",")):
        prompts = kv.long_prompts(target, args.prompts, context)
        print(f"context {context}: {len(prompts)} prompts of {[len(p['tokens']) for p in prompts]} tokens", flush=True)
        part = kv.curve(target, prompts, policies, retentions, depth=args.depth, new_tokens=args.new_tokens,
                        mal_prompts=args.mal_prompts, log=lambda line: print(line, flush=True))
        rows += [{"context": context, **r} for r in part]
        verdicts[str(context)] = kv.verdict(part, "accept", args.bootstrap)
        print(f"context {context}: lowest retention within {kv.MARGIN:.0%}: {verdicts[str(context)]['lowest']}, "
              f"A/A control {verdicts[str(context)]['control']}", flush=True)
    result = {"bench": "self_draft", "model": target.label, "contexts": args.contexts,
              "prompts_per_context": args.prompts, "policies": policies, "retentions": retentions,
              "new_tokens": args.new_tokens, "depth": args.depth, "mal_prompts": args.mal_prompts,
              "seconds": round(time.perf_counter() - started, 1), "verdicts": verdicts, "rows": rows}
    records.emit("self_draft", result, threads=torch.get_num_threads())
    return result


if __name__ == "__main__":
    main()
