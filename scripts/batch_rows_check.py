"""Does a batch step's price need its rows? A check on a `size=batch` store, not a benchmark.

Owns one comparison, per batch cell and per drafted run (the kernel's and fp32's): the measured time of
the drafted batch's target forwards against prices anchored on the same cell's plain batch: *width
only* (every step at L_B(w) / L_B(1) x the plain mean step), *rows, linear* (a step of r rows at
L_1(w) + (L_B(w) - L_1(w)) (r - 1) / (B - 1)), *rows, curves* (L_r(w), the cell's curve at r rows) and
*rows, anchored* (the cost model's f_r L_r(w) / L_r(1)); the last two need the fewer rows' curves and
forward times per shape. Last, per cell, each held-out speculation prediction priced by rows and by
width only. Knows nothing about reports; prints lines, not a page.

    python scripts/batch_rows_check.py results/batch     # after python -m experiments.main size=batch
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout, not an installed copy

from experiments import heldout  # noqa: E402
from experiments.report import load_cells  # noqa: E402
from specdec.measure import costmodel  # noqa: E402


def _scaled(plain: dict, drafted: dict, plain_s: float, price: Callable[[int, int], float]) -> float:
    """The drafted steps priced by `price`, scaled so that the plain steps cost `plain_s`."""
    return plain_s / sum(n * price(*shape) for shape, n in plain.items()) * sum(
        n * price(*shape) for shape, n in drafted.items())


def check_role(cell, c: int, curves: tuple, drafted: str, plain: str, role: str) -> None:
    """One role's drafted runs (the kernel's or fp32's): the forwards measured against each pricing."""
    r, batch = cell.rows, cell.labels["batch"]
    curve_b, curve_1, by_rows = curves
    plain_n, drafted_n = (heldout.shapes(r, p) for p in (plain, drafted))
    plain_t, drafted_t = (heldout.shapes(r, p, "shape_forward_s") for p in (plain, drafted))
    timed = plain_t is not None and drafted_t is not None
    if timed:  # the target's forwards alone
        plain_s, measured = sum(plain_t.values()), sum(drafted_t.values())
    else:  # everything but drafting
        plain_s, measured = (float(r[f"{p}batch_verify_time_s"].sum()) for p in (plain, drafted))
    prices = {"width only": lambda k, w: curve_b.at(w, c),
              "rows, linear": lambda k, w: curve_1.at(w, c) + (curve_b.at(w, c) - curve_1.at(w, c))
              * (k - 1) / (batch - 1)}
    out = {name: _scaled(plain_n, drafted_n, plain_s, price) for name, price in prices.items()}
    if len(by_rows) == batch:
        out["rows, curves"] = _scaled(plain_n, drafted_n, plain_s, lambda k, w: by_rows[k].at(w, c))
    if len(by_rows) == batch and timed:  # the cost model's price of a step, its forward alone
        forwards = costmodel.PlainRun(new_tokens=0, seconds=0.0, prefill_s=0.0, forward_s=0.0, context=c,
                                      batch=batch, row_forward_s=heldout.row_forwards(r, plain))
        out["rows, anchored"] = sum(n * costmodel.batch_step_s(forwards, k, w, by_rows)
                                    for (k, w), n in drafted_n.items())
    shown = "; ".join(f"{name} {s:.2f} s ({s / measured - 1:+.0%})" for name, s in out.items())
    print(f"{cell.name}, {role}'s drafted runs: forwards measured {measured:.2f} s; {shown}")
    if timed and len(by_rows) == batch:
        ones_ms = "; ".join(f"{k} rows {plain_t[k, 1] / n * 1e3:.1f} ms in the loop, "
                            f"{by_rows[k].at(1, c) * 1e3:.1f} on the curve"
                            for (k, w), n in sorted(plain_n.items(), reverse=True) if w == 1)
        print(f"{cell.name}, {role}'s plain one-token forward: {ones_ms}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a results store with batch-1 and batch-B cells of the same kernels")
    args = parser.parse_args(argv)
    cells = load_cells(args.results)
    ones = {c.quant: c for c in cells if c.labels["batch"] == 1}
    for cell in (c for c in cells if c.labels["batch"] > 1):
        r = cell.rows
        if "batch_verify_shapes" not in r or cell.quant not in ones:
            print(f"{cell.name}: no batch_verify_shapes or no batch-1 cell of {cell.quant}: skipped")
            continue
        c = heldout.row_context(r)
        for curves, drafted, plain, role in zip(zip(cell.curves(), ones[cell.quant].curves(), cell.row_curves()),
                                                ("", "reference_drafted_"), ("baseline_", "reference_"),
                                                ("kernel", "fp32")):
            check_role(cell, c, curves, drafted, plain, role)
        curve, by_rows = cell.curves()[0], cell.row_curves()[0]
        for priced, width_only in zip(heldout.predictions(cell.cell_id, cell.labels, r, curve, by_rows),
                                      heldout.predictions(cell.cell_id, cell.labels, r, curve)):
            print(f"{cell.name}, speculation held out by {priced.kind} {priced.part}: measured {priced.measured:.3f}x; "
                  f"by rows {priced.predicted:.3f}x ({priced.error(priced.predicted):.1%} off); "
                  f"width only {width_only.predicted:.3f}x ({width_only.error(width_only.predicted):.1%} off)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
