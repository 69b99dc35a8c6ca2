"""Latency curve of a target under each linear kernel (specdec.runtime.kernels), interleaved in one run.

    python scripts/bench_kernels.py                                   # embedded target: none, bf16, torchao_int4
    python scripts/bench_kernels.py --specs none --widths 1,4,8 --repeats 3
    python scripts/bench_kernels.py --target tiny-llama --specs none --widths 1,4 --contexts 8 --repeats 1   # smoke

Per spec and context: forward milliseconds per kernel (`onednn`, `hybrid`, `torch`) and width, each
relative to `torch` at width 1, and the kernel `auto` picks here; kernels that cannot run a spec are
listed with the reason; then one JSON line. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys

import torch

import specdec
from specdec.measure import records
from specdec.runtime import kernels
from specdec.machine import machine_name
from specdec.measure.latency import measure_latency


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def curves(target: specdec.Target, names: list[str], widths: tuple[int, ...], context: int,
           repeats: int) -> dict[str, list[float]]:
    """Median forward seconds per kernel of `names` and width, kernels interleaved per repeat."""
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            if name == "torch":
                with kernels.plain_linears(target.model):
                    curve = measure_latency(dataclasses.replace(target, kernel="torch"), widths, (context,), 1)
            else:  # onednn / hybrid: the same packed weights, one-row products switched
                kernels.apply_kernel(target.model, name)
                curve = measure_latency(dataclasses.replace(target, kernel=name), widths, (context,), 1)
            times[name].append(list(curve.seconds[0]))
    return {name: [statistics.median(run[i] for run in runs) for i in range(len(widths))]
            for name, runs in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="a specdec.load_target name or path")
    parser.add_argument("--specs", default="none,bf16,torchao_int4", help="comma-separated quantization specs")
    parser.add_argument("--widths", type=_ints, default=(1, 2, 4, 8, 16, 32, 64))
    parser.add_argument("--contexts", type=_ints, default=(256,))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    if not args.widths or args.widths[0] != 1:
        raise SystemExit(f"error: --widths must start at 1, got {list(args.widths)}")
    torch.set_num_threads(args.threads)
    results = []
    for spec in (s for s in args.specs.split(",") if s):
        target = specdec.load_target(args.target, quant=spec)  # kernel="auto": its choice, measured once
        auto = target.kernel
        names = kernels.candidates(target.device, target.dtype)
        skipped = {n: kernels.why_not(n, target.device, target.dtype) for n in kernels.KERNELS if n not in names}
        if "onednn" in names:
            target = kernels.use_kernel(target, "onednn")  # the torch rows unpack it per measurement
        for context in args.contexts:
            seconds = curves(target, names, args.widths, context, args.repeats)
            base = seconds["torch"][0]
            print(f"== {target.label} ({target.dtype}), {context} cached tokens, {machine_name(target.device)}, "
                  f"{torch.get_num_threads()} thread(s); auto picks {auto}")
            print("   kernel  " + " ".join(f"{'@' + str(w):>8s}" for w in args.widths))
            for name, row in seconds.items():
                print(f"   {name:7s} " + " ".join(f"{t * 1e3:6.1f}ms" for t in row))
                print(f"   {'':7s} " + " ".join(f"{t / base:7.2f}x" for t in row))
            for name, why in skipped.items():
                print(f"   {name}: not run ({why})")
            results.append({"spec": spec, "label": target.label, "dtype": str(target.dtype), "context": context,
                            "auto": auto, "seconds": seconds, "skipped": skipped})
        del target
    records.emit("kernels", {"bench": "kernels", "target": args.target, "machine": machine_name("cpu"),
                      "arch": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "widths": list(args.widths), "repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
