"""Does a batch step's price need its rows? A check on a `size=batch` store, not a benchmark.

Owns one comparison, per batch cell and per drafted run (the kernel's and fp32's): the summed time of
the drafted batch's target forwards as measured, against two prices anchored on the same cell's plain
batch (`experiments.heldout`'s rule: the curve as a ratio, scaled so the plain run's steps cost what
they measured):
- *width only* (the cost model's): every step at the batch's curve, L_B(w) / L_B(1) x the plain mean step;
- *rows too*: a step with r rows left and width w at L_1(w) + (L_B(w) - L_1(w)) (r - 1) / (B - 1), linear
  in rows between the batch-1 cell's curve and the batch cell's, from `batch_verify_shapes`.
Knows nothing about reports; prints one line per run.

    python scripts/batch_rows_check.py results/batch     # after python -m experiments.main size=batch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not an installed copy

from experiments import heldout  # noqa: E402
from experiments.report import load_cells  # noqa: E402


def _shapes(column) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for shapes in column:
        for key, n in shapes.items():
            rows, width = map(int, key.split("x"))
            out[rows, width] = out.get((rows, width), 0) + int(n)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a results store with batch-1 and batch-B cells of the same kernels")
    args = parser.parse_args(argv)
    cells = load_cells(args.results)
    ones = {c.quant: c for c in cells if c.labels["batch"] == 1}
    for cell in (c for c in cells if c.labels["batch"] > 1):
        r, batch = cell.rows, cell.labels["batch"]
        if "batch_verify_shapes" not in r or cell.quant not in ones:
            print(f"{cell.name}: no batch_verify_shapes or no batch-1 cell of {cell.quant}: skipped")
            continue
        context = heldout.row_context(r)
        for (curve_b, curve_1), drafted, plain, role in zip(zip(cell.curves(), ones[cell.quant].curves()),
                                                            ("", "reference_drafted_"), ("baseline_", "reference_"),
                                                            ("kernel", "fp32")):
            def price(rows: int, width: int) -> float:
                one = curve_1.at(width, context)
                return one + (curve_b.at(width, context) - one) * (rows - 1) / (batch - 1)

            plain_s = float(r[f"{plain}batch_verify_time_s"].sum())
            plain_shapes = _shapes(r[f"{plain}batch_verify_shapes"])
            drafted_shapes = _shapes(r[f"{drafted}batch_verify_shapes"])
            measured = float(r[f"{drafted}batch_verify_time_s"].sum())
            width_only = plain_s / sum(plain_shapes.values()) * sum(
                n * curve_b.at(w, context) / curve_b.at(1, context) for (_, w), n in drafted_shapes.items())
            rows_too = plain_s / sum(n * price(k, w) for (k, w), n in plain_shapes.items()) * sum(
                n * price(k, w) for (k, w), n in drafted_shapes.items())
            print(f"{cell.name}, {role}'s drafted runs: forwards measured {measured:.2f} s; width only "
                  f"{width_only:.2f} s ({width_only / measured - 1:+.0%}); rows too {rows_too:.2f} s "
                  f"({rows_too / measured - 1:+.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
