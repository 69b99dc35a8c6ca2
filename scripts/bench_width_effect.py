"""Measure the width effect on the embedded target (TV per token, 95% CI over prompts) and the bf16
near-tie allowance of tests/test_embedded.py derived from it (NEAR_TIE_MARGIN x the largest top-2
gap shift). Recorded (kind `width_effect`) and printed as one JSON line.

    python scripts/bench_width_effect.py [--dtype float32]   # default bf16, eagle, 12 prompts x 32 tokens
"""

from __future__ import annotations

import argparse
import time

import specdec
from specdec.measure import records
from specdec.measure.width_effect import PROMPTS, SHAPES, TEMPERATURES, width_effect

NEAR_TIE_MARGIN = 2.0
"""Allowance = margin x the largest measured top-2 gap shift (the shift of one run on one machine
is a sample: the margin covers prompts and widths not measured)."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--quant", default=None)
    parser.add_argument("--drafter", default="eagle")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many (<= {len(PROMPTS)}, >= 8)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per run")
    parser.add_argument("--shapes", default=";".join(SHAPES))
    parser.add_argument("--temperatures", default=",".join(map(str, TEMPERATURES)))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 2 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts {args.prompts}: between 2 and {len(PROMPTS)}")
    target = specdec.load_target(args.target, dtype=args.dtype, kernel=args.kernel, quant=args.quant,
                                 threads=args.threads)
    drafter = specdec.drafters.build(args.drafter, target=target)
    start, cpu = time.perf_counter(), time.process_time()
    effect = width_effect(target, drafter, PROMPTS[: args.prompts], shapes=args.shapes.split(";"),
                          temperatures=[float(t) for t in args.temperatures.split(",")], tokens=args.tokens)
    result = effect.summary()
    result["near_tie_margin"] = NEAR_TIE_MARGIN
    result["near_tie_allowance"] = NEAR_TIE_MARGIN * result["max_gap_shift"]
    result["near_tie_derivation"] = (f"{NEAR_TIE_MARGIN:g} x the largest shift of the plain top-1 minus top-2 logit gap "
                                     f"in a drafted run ({result['max_gap_shift']:.4g}, over {effect.prompts} prompts x "
                                     f"{len(result['shapes'])} shapes x {args.tokens} tokens per temperature)")
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["cpu_s"] = round(time.process_time() - cpu, 1)
    records.emit("width_effect", result, threads=args.threads)
    return result


if __name__ == "__main__":
    main()
