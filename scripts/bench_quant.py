"""Latency curve, top-1 agreement and KL (`specdec.quant.quant_report`) of every quantization backend available here;
unavailable specs are listed with the reason. Prints a card, then one JSON line.

    python scripts/bench_quant.py [--specs bf16,torchao_int4,rtn4] [--target tiny-llama --widths 1,4]
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import platform
import sys
import time

import torch

import specdec
from specdec.measure import records
from specdec import quant

DEFAULT_SPECS = (
    "none", "bf16", "fp16", "rtn8", "rtn6", "rtn4", "rtn4_g32", "rtn4_sym", "rtn3", "rtn2",
    "torchao_int4", "torchao_int4_g64", "torchao_int8", "dynamic_int8", "dynamic_fp16",
    "bnb_int8", "bnb_nf4", "bnb_fp4", "hqq8", "hqq4", "hqq4_g64", "hqq3", "hqq2", "gptq4",
)
LIBRARIES = ("torch", "transformers", "torchao", "bitsandbytes", "hqq", "gptqmodel")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _row(spec: str, result: dict, widths: list[int]) -> str:
    if result["status"] != "ok":
        return f"| {spec} | {result['status']}: {result['reason']} |"
    q = result["report"]["quant"]
    bits_q = q["nominal_bits_per_quantized_weight"] or q["bits_per_quantized_weight"]
    cells = [result["report"]["quantized"].split("@")[-1], f"{bits_q:.2f}" if bits_q else "-",
             f"{q['bits_per_param']:.2f}", f"{result['report']['top1_agreement']:.3f}",
             f"{result['report']['mean_kl']:.3g}"]
    latency = result["report"].get("latency")
    if latency:
        for ratios in latency["ratio"]:
            cells += [f"{r:.2f}" for r in ratios]
    return "| " + " | ".join(cells) + " |"


def run_specs(reference, specs: list[str], config) -> dict[str, dict]:
    """{spec: {status ok + report | unavailable | invalid, reason}}: each backend's quant_report."""
    results: dict[str, dict] = {}
    start = time.time()
    for spec in specs:
        available = quant.availability(spec, reference.device)
        if not available.ok:
            results[spec] = {"status": "unavailable", "reason": available.reason}
            continue
        try:
            quantized = quant.quantized_copy(reference, spec)
        except quant.QuantSpecError as err:  # e.g. a group size this model's widths do not allow
            results[spec] = {"status": "invalid", "reason": str(err)}
            continue
        results[spec] = {"status": "ok", "report": quant.quant_report(reference, quantized, config)}
        del quantized
        gc.collect()
        print(f"# {spec}: done ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    return results


def card(args, specs: list[str], results: dict[str, dict], config) -> None:
    """The human card: how to read it, confounds, one table row per spec, the unquantized times."""
    header = ["spec", "bits/qweight", "bits/param", "top-1", "KL"] + [
        f"@{w} c{c}" for c in config.contexts for w in config.widths]
    print(f"Quantization backends on {args.target} ({platform.machine()}, {args.threads} thread(s), "
          f"{torch.get_num_threads()} used): forward time as a ratio to the unquantized target timed "
          f"interleaved in the same run (< 1 = faster), for @N new tokens after c cached tokens; top-1 "
          f"agreement and mean KL(unquantized || quantized) on {config.eval_tokens} tokens of the fixed "
          f"eval text. bits/qweight: bits per quantized linear weight incl. scales (nominal if stored "
          f"dequantized); bits/param: measured bytes of the whole model per parameter.")
    confounds = next((r["report"]["confounds"] for r in results.values() if r["status"] == "ok"), [])
    for note in confounds:
        print(f"Confound: {note}.")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for spec in specs:
        print(_row(spec, results[spec], list(config.widths)))
    ms = next((r["report"]["latency"]["reference_ms"] for r in results.values()
               if r["status"] == "ok" and "latency" in r["report"]), None)
    for context, row in zip(config.contexts, ms or []):
        print(f"Unquantized forward ms after {context} cached tokens (last spec's run): "
              + ", ".join(f"@{w} {t:.1f}" for w, t in zip(config.widths, row)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="a specdec.load_target name or path")
    parser.add_argument("--specs", default=",".join(DEFAULT_SPECS), help="comma-separated quantization specs")
    parser.add_argument("--widths", type=_ints, default=quant.ReportConfig.widths, help="tokens per forward: 1,2,4")
    parser.add_argument("--contexts", type=_ints, default=quant.ReportConfig.contexts, help="cached context lengths")
    parser.add_argument("--repeats", type=int, default=quant.ReportConfig.repeats, help="timed forwards per cell")
    parser.add_argument("--eval-tokens", type=int, default=quant.ReportConfig.eval_tokens)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = quant.ReportConfig(widths=args.widths, contexts=args.contexts, repeats=args.repeats,
                                eval_tokens=args.eval_tokens)
    specs = [s for s in args.specs.split(",") if s]
    reference = specdec.load_target(args.target)
    start = time.time()
    results = run_specs(reference, specs, config)
    card(args, specs, results, config)
    records.emit("quant", {
        "target": args.target, "threads": args.threads, "config": {**vars(args), "widths": list(args.widths),
                                                                  "contexts": list(args.contexts)},
        "versions": {name: _version(name) for name in LIBRARIES}, "wall_s": round(time.time() - start, 1),
        "results": results,
    })
    return 0

if __name__ == "__main__":
    sys.exit(main())
