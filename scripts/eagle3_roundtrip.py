"""An EAGLE-3 head's speculators export, checked end to end: same tensors, same drafts, same MAL, the package parses it.

    nice -n 19 python scripts/eagle3_roundtrip.py --trained outputs/eagle3-head \\
        --exported outputs/eagle3-export --bf16 outputs/eagle3-export-bf16 --target smollm2-135m

--trained is the directory scripts/train_eagle3.py saved (float32), --exported what
scripts/export_speculators.py --dtype float32 wrote from it, --bf16 (optional) the bfloat16 export.
For each, the `eagle` drafter built from the directory (head run in float32, so the bf16 export differs
only by its rounded weights) generates --max-new-tokens greedy tokens for each of the first --prompts
questions of --suite (chat prompts no training set here holds, checked by prompt id against --sets) at
every --shapes shape; the plain loop generates the same prompts once. Reports, per directory and
shape, the pooled mean acceptance length (bonus included) and whether every output equals the plain
loop's, whether the float32 export's tensors and per-step acceptances equal the trained head's, and the
speculators package's parse of each export (scripts/export_speculators.py `package_check`). The result
is recorded through specdec.measure.records (kind `eagle3-export`) with --training (train_eagle3.py's
curve.json summary) and printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import specdec  # noqa: E402
from bench_eagle import load_prompts  # noqa: E402
from export_speculators import package_check  # noqa: E402
from specdec.core.metrics import GenerationStats  # noqa: E402
from specdec.measure import records  # noqa: E402
from specdec.training.prompts import user  # noqa: E402
from specdec.training.tokens import TokenSet, prompt_id  # noqa: E402


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two speculators directories hold the same tensor names, dtypes and values."""
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--trained", type=Path, required=True)
    ap.add_argument("--exported", type=Path, required=True)
    ap.add_argument("--bf16", type=Path, default=None)
    ap.add_argument("--suite", type=Path, default=ROOT / "experiments" / "prompts" / "chat_heldout.jsonl")
    ap.add_argument("--sets", nargs="*", default=["data/eagle/smollm2-135m/greedy-192"],
                    help="rollout sets the prompts must not be in")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--shapes", nargs="+", default=["chain(4)", "dynamic(top_k=8,depth=6,budget=32)"])
    ap.add_argument("--training", type=Path, default=None, help="train_eagle3.py's curve.json (default: --trained's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true", help="print only (no records entry)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = specdec.load_target(args.target, kernel="torch", threads=args.threads)
    prompts = load_prompts(args.suite, args.prompts)
    seen = set().union(*(TokenSet.open(s).done() for s in args.sets)) if args.sets else set()
    overlap = [p for p in prompts if prompt_id(user(p)) in seen]
    if overlap:
        raise SystemExit(f"{len(overlap)} prompts of {args.suite} are in the training sets {args.sets}, e.g. {overlap[0]!r}")
    plain = [specdec.generate(target, None, p, max_new_tokens=args.max_new_tokens).token_ids for p in prompts]
    heads = {"trained": args.trained, "exported_fp32": args.exported, **({"exported_bf16": args.bf16} if args.bf16 else {})}
    runs: dict[str, dict] = {}
    accepted: dict[str, list] = {}
    for label, directory in heads.items():
        drafter = specdec.drafters.build("eagle", target=target, head=directory, head_dtype=torch.float32)
        runs[label] = {}
        for shape in args.shapes:
            outs = [specdec.generate(target, drafter, p, shape=shape, max_new_tokens=args.max_new_tokens) for p in prompts]
            pooled = GenerationStats.merge([o.stats for o in outs])
            runs[label][shape] = {"mal": round(pooled.mean_acceptance_length, 4), "steps": pooled.num_steps,
                                  "equals_plain": all(o.token_ids == t for o, t in zip(outs, plain))}
            accepted[f"{label}/{shape}"] = [[s.accepted for s in o.stats.steps] for o in outs]
    result = {
        "target": args.target, "suite": str(args.suite.relative_to(ROOT) if args.suite.is_relative_to(ROOT) else args.suite),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "head_dtype": "float32", "mal": runs,
        "fp32_export_same_tensors": same_tensors(args.trained, args.exported),
        "fp32_export_same_steps": all(accepted[f"trained/{s}"] == accepted[f"exported_fp32/{s}"] for s in args.shapes),
        "package_check": {label: package_check(d) for label, d in heads.items() if label != "trained"},
    }
    curve = args.training or args.trained / "curve.json"
    if curve.exists():
        summary = json.loads(curve.read_text())["summary"]
        result["training"] = {k: summary[k] for k in ("steps", "minutes", "train_sequences", "val_sequences",
                                                      "aux_layers", "draft_vocab", "depth", "batch_size", "max_len", "lr")}
        result["training"]["best_validation"] = {k: summary["best"][k] for k in summary["best"]
                                                 if k.startswith(("acc@", "chain_mal", "step", "positions"))}
    if args.no_record:
        print(json.dumps(result), flush=True)
    else:
        records.emit("eagle3-export", result, threads=args.threads)
    return result


if __name__ == "__main__":
    main()
