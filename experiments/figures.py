"""The findings report's figures: latency curves per kernel, the compound-speedup heatmap, the
interaction per cell with its interval, and the held-out cost model's predictions against measurement.

Owns their layout only: sizes grow with the grid, labels are never clipped (constrained layout,
figure size from the label count), kernels get distinct colour + line style + marker, numerics-only
kernels are drawn apart (hatched column, hollow markers). No figure warns, whatever the grid size.
Knows nothing about stores: it draws the frames and curves it is given.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from specdec.core.curve import LatencyCurve

STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=100, metadata={"Software": None})
    _pyplot().close(fig)


def kernel_style(index: int) -> dict:
    """Colour, line style and marker of the index-th kernel: no two kernels of one figure share all three."""
    return {"color": f"C{index % 10}", "linestyle": STYLES[index % len(STYLES)], "marker": MARKERS[index % len(MARKERS)]}


def plot_latency(curves: dict[str, LatencyCurve], path: Path) -> None:
    """Forward time and its ratio to a 1-token forward, against width, one style per kernel (contexts:
    solid = smallest, faded = largest)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for k, (label, curve) in enumerate(sorted(curves.items())):
        style = kernel_style(k)
        for context, row in zip(curve.contexts, curve.seconds):
            alpha = 1.0 if context == curve.contexts[0] else 0.45
            axes[0].plot(curve.widths, [1e3 * s for s in row], alpha=alpha, label=f"{label} c={context}", **style)
            axes[1].plot(curve.widths, [s / row[0] for s in row], alpha=alpha, label=f"{label} c={context}", **style)
    axes[0].set(xscale="log", xlabel="forward width (tokens)", ylabel="ms per forward", title="latency curve")
    axes[1].set(xscale="log", xlabel="forward width (tokens)", ylabel="x one-token forward",
                title="cost of a wide verify, per kernel")
    for ax in axes:
        ax.grid(alpha=0.3)
    if curves:
        axes[1].legend(fontsize=7, loc="upper left")
    _save(fig, path)


def plot_heatmap(grid: pd.DataFrame, numerics: set[str], path: Path) -> None:
    """Compound speedup (drafted on the kernel / fp32 plain): rows = drafter x shape, columns =
    kernels (numerics-only columns last, marked * and hatched)."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    values = grid.to_numpy(dtype=float)
    width = max(len(str(c)) for c in grid.columns) if len(grid.columns) else 4
    height = max((len(str(r)) for r in grid.index), default=4)
    fig, ax = plt.subplots(figsize=(1.5 + 0.08 * height + 1.2 * max(1, len(grid.columns)),
                                    1.4 + 0.06 * width + 0.45 * max(1, len(grid.index))), constrained_layout=True)
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 1.0)
    image = ax.imshow(values, cmap="RdYlGn", norm=TwoSlopeNorm(1.0, min(0.5, lo), max(1.5, hi)), aspect="auto")
    for (i, j), v in np.ndenumerate(values):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
    for j, column in enumerate(grid.columns):
        if column in numerics:
            ax.add_patch(plt.Rectangle((j - 0.5, -0.5), 1, len(grid.index), fill=False, hatch="//", alpha=0.4))
    ax.set_xticks(range(len(grid.columns)), [c + (" *" if c in numerics else "") for c in grid.columns],
                  rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(grid.index)), list(grid.index), fontsize=8)
    ax.set_title("compound speedup over fp32 plain\n(* numerics only: fp32 cost)", fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8)
    _save(fig, path)


def plot_interactions(frame: pd.DataFrame, path: Path, margin: float) -> None:
    """Interaction (speculation on the kernel / on fp32) per cell with its 95% interval; the fight line
    (1.0) and the equivalence margin drawn; the A/A control first."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.35 * max(1, len(frame))), constrained_layout=True)
    for i, r in enumerate(frame.itertuples()):
        if np.isfinite(r.lo):
            ax.plot([r.lo, r.hi], [i, i], color="k", lw=1.5)
        ax.plot([r.point], [i], "o", color={"fight": "C3", "compound": "C2"}.get(r.label, "C7"))
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(margin, color="C1", lw=0.8, ls="--", label=f"equivalence margin {margin}")
    ax.set_yticks(range(len(frame)), list(frame.name), fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="interaction (95% CI over prompts)", title="green: compound, red: fight, grey: inconclusive")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_heldout(frame: pd.DataFrame, path: Path) -> None:
    """Held-out predictions of speculation against measurement, one marker per kind, hollow for
    numerics-only cells; the constant null is the horizontal line 1.0."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.6), constrained_layout=True)
    values = frame[["measured", "predicted", "flat"]].to_numpy(float) if len(frame) else np.ones((1, 3))
    lo, hi = min(0.5, float(values.min()) * 0.9), max(1.6, float(values.max()) * 1.1)
    xs = np.linspace(lo, hi, 2)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs / 1.25, xs * 1.25, color="grey", alpha=0.15, label="within 25%")
    ax.axhline(1.0, color="C7", lw=0.8, ls=":", label="constant null (1.0x)")
    for k, (kind, part) in enumerate(frame.groupby("kind", sort=True) if len(frame) else []):
        for numerics, sub in part.groupby("numerics_only"):
            ax.scatter(sub.measured, sub.predicted, s=26, marker=MARKERS[k], color=f"C{k}",
                       facecolors="none" if numerics else f"C{k}",
                       label=f"held-out {kind}" + (" (numerics only)" if numerics else ""))
            ax.scatter(sub.measured, sub.flat, s=14, marker=MARKERS[k], color="C7", alpha=0.5,
                       label=f"flat-curve null, {kind}" if not numerics else None)
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured speculation speedup", ylabel="predicted (held out)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)
