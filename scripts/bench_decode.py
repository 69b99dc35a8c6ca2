"""Decoding speed: specdec's loop (plain and with drafters x shapes) against Hugging Face `generate`.

Same target, prompts, lengths and greedy decoding, all configurations back to back per prompt; prints a card per
configuration (tokens/s, ratios to HF, MAL, step-time split, outputs equal to the plain loop's), then one JSON line.
--cache: `specdec.runtime.forwards.CACHES` (not `dynamic`: a `plain[cache=dynamic]` row too). --latency: forward
time per width first. --prompts: `chat_heldout` or `FILE.jsonl[:category,category]`. --quant: a quantized target.
--by-category (no HF runs; --num-prompts per category): is `auto` never slower than plain and its best fixed shape?

    python scripts/bench_decode.py --by-category --prompts experiments/prompts/default.jsonl --num-prompts 2

    python scripts/bench_decode.py [--model smollm2-135m] [--device cpu] [--kernel auto]
        [--drafters "eagle,eagle[head_dtype=bfloat16],ngram"]
        [--shapes "chain(4);dynamic(8,6,32);auto"] [--prompts chat_heldout] [--num-prompts 6]
        [--new-tokens 64] [--threads 1] [--cache auto] [--latency 1,2,4,...,128]
"""

from __future__ import annotations

import platform
import sys

import torch

import specdec
from specdec.machine import machine_name
from specdec.measure import records
from experiments.decode_speed import by_category, configurations, load_prompts, parse, race, rows
from specdec.measure.latency import measure_latency
from specdec.runtime.forwards import resolve_cache
from specdec.tune import ensure_tuned


def print_latency(target: specdec.Target, widths: tuple[int, ...], cache: str) -> None:
    """The target's forward time per width after 256 cached tokens, through `cache` and `dynamic`."""
    kinds = dict.fromkeys([cache, "dynamic"])
    curves = {kind: measure_latency(target, widths, (256,), repeats=5, cache=kind) for kind in kinds}
    print(f"== latency ({target.label}, {target.dtype}, {target.device}, 256 cached tokens, median of 5): ms per forward")
    print("   " + f"{'width':>6s}" + "".join(f"{kind:>10s}" for kind in kinds))
    for w in widths:
        print("   " + f"{w:6d}" + "".join(f"{curves[kind].at(w) * 1e3:10.2f}" for kind in kinds))
    records.emit("latency", {"bench": "latency", "model": target.label, "device": str(target.device), "widths": list(widths),
                      "ms": {kind: [curves[kind].at(w) * 1e3 for w in widths] for kind in kinds}}, device=str(target.device))


def card(target, args, cache: str, table: list[dict], prompts: int) -> None:
    """The human card: one line per configuration."""
    print(f"== decoding speed ({target.label}, {target.dtype}, {target.device}, kernel {target.kernel}, cache {cache}, "
          f"greedy, {args.new_tokens} new tokens, {prompts} prompts from {args.prompts})")
    print(f"   machine: {machine_name(target.device)} ({platform.machine()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; configurations interleaved per prompt")
    print(f"   {'configuration':34s} {'tok/s':>7s} {'vs HF':>6s} {'vs PLD':>6s} {'MAL':>5s} "
          f"{'target':>6s} {'draft':>6s} {'other':>6s} {'=plain':>6s}")
    for row in table:
        text = f"   {row['config']:34s} {row['tokens_per_s']:7.2f} {row['vs_hf_generate']:6.2f} {row['vs_hf_prompt_lookup']:6.2f}"
        split = row.get("split")
        text += (f" {row['mal']:5.2f} {split['target']:6.0%} {split['draft']:6.0%} {split['other']:6.0%}" if split
                 else f" {'':5s} {'':6s} {'':6s} {'':6s}")
        parted = row["first_difference"]
        parts = f" (first differs at token {', '.join(map(str, parted))})" if parted else ""
        print(text + f" {row['identical_to_plain']:>3d}/{prompts}{parts}")


def category_card(table: list[dict]) -> None:
    """The --by-category table: auto's tokens/s over plain's and over the fastest fixed shape, mean [95% CI]."""
    print(f"   {'category':14s} {'drafter':10s} {'n':>2s} {'auto/plain':>22s} {'auto/best fixed':>22s} best fixed")
    for r in table:
        cells = " ".join(f"{m:6.2f} [{lo:5.2f}, {hi:5.2f}]" for m, lo, hi in (r["vs_plain"], r["vs_best_fixed"]))
        print(f"   {r['category']:14s} {r['drafter']:10s} {r['prompts']:2d} {cells}  {r['best_fixed']}"
              + ("" if r["never_slower"] else "  SLOWER"))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv, __doc__.splitlines()[0])
    prompts = load_prompts(args.prompts, args.num_prompts, per_category=args.by_category)
    categories = [c for c, _ in prompts] if args.by_category else []
    prompts = [p for _, p in prompts] if args.by_category else prompts
    if args.device == "cpu" and args.dtype in (None, "float32") and args.kernel == "auto":
        ensure_tuned(args.model, args.threads, quant=args.quant)
    target = specdec.load_target(args.model, device=args.device, dtype=args.dtype, kernel=args.kernel,
                                 threads=args.threads, quant=args.quant)
    try:
        cache = resolve_cache(args.cache, target)
        widths = tuple(int(w) for w in args.latency.split(",") if w.strip())
    except ValueError as err:
        raise SystemExit(f"error: --cache / --latency: {err}") from None
    if widths:
        print_latency(target, widths, cache)
    configs = configurations(target, args, cache)
    got = race(target, configs, [target.encode_prompt(p) for p in prompts])
    table = rows(got)
    card(target, args, cache, table, len(prompts))
    extra = {"by_category": by_category(got, categories)} if categories else {}
    if extra:
        category_card(extra["by_category"])
    records.emit("decode", {**extra, "bench": "decode", "model": target.label, "device": str(target.device), "kernel": target.kernel,
                      "cache": cache,
                      "dtype": str(target.dtype), "machine": machine_name(target.device), "prompts": args.prompts,
                      "num_prompts": len(prompts), "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
                      "configs": table}, device=str(target.device))


if __name__ == "__main__":
    sys.exit(main())
