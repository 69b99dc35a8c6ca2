"""The report's and the leaderboard's figures: latency curves per kernel, heatmaps, acceptance per draft
position, the interaction per cell, and the held-out cost model's predictions against measurement.

Owns their layout only: sizes grow with the cells present, labels and titles are never clipped,
kernels get distinct colour + line style + marker, numerics-only kernels are drawn apart. No figure
warns, whatever the grid size. Knows nothing about stores: it draws the frames and curves it is given.
"""

from __future__ import annotations

import textwrap
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


def _wrapped(title: str, width_in: float, fontsize: float = 9) -> str:
    """`title` broken into lines that fit `width_in` inches at `fontsize` points (a character ~0.6 em)."""
    return textwrap.fill(title, max(20, int(width_in * 72 / (0.6 * fontsize))))


def plot_latency(curves: dict[str, list[LatencyCurve]], path: Path) -> None:
    """Forward time and its ratio to a 1-token forward, against width, one style per kernel (contexts:
    solid = smallest, faded = largest): the median over the curves a kernel has (one per cell that
    measured it), their min..max as a band."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for k, (label, measured) in enumerate(sorted(curves.items())):
        style = kernel_style(k)
        times = np.array([c.seconds for c in measured])  # [curves, contexts, widths]
        first = measured[0]
        for i, context in enumerate(first.contexts):
            alpha = 1.0 if i == 0 else 0.45
            for ax, scale in ((axes[0], 1e3), (axes[1], 1 / times[:, i, :1])):
                band = times[:, i, :] * scale  # [curves, widths]
                ax.plot(first.widths, np.median(band, 0), alpha=alpha, label=f"{label} c={context} ({len(band)})",
                        **style)
                if len(band) > 1:
                    ax.fill_between(first.widths, band.min(0), band.max(0), color=style["color"], alpha=0.15 * alpha)
    axes[0].set(xscale="log", xlabel="forward width (tokens)", ylabel="ms per forward",
                title="latency curve (median of the cells' curves, band: min..max)")
    axes[1].set(xscale="log", xlabel="forward width (tokens)", ylabel="x one-token forward",
                title="cost of a wide verify, per kernel")
    for ax in axes:
        ax.grid(alpha=0.3)
    if curves:
        axes[1].legend(fontsize=7, loc="upper left", title="kernel, context (curves)", title_fontsize=7)
    _save(fig, path)


def compact(grid: pd.DataFrame, numerics: set[str] = frozenset()) -> pd.DataFrame:
    """`grid` without its empty rows and columns; when a third or more of what is left is blank, one column
    of the cells present (`row on column`, numerics-only marked *) instead: no heatmap is mostly blank."""
    grid = grid.dropna(how="all").dropna(axis=1, how="all")
    if grid.size == 0 or grid.notna().to_numpy().mean() > 2 / 3:
        return grid
    present = grid.stack().dropna()
    return pd.DataFrame({"": present.to_numpy()},
                        index=[f"{r} on {c}" + (" *" if c in numerics else "") for r, c in present.index])


def plot_heatmaps(panels: dict[str, pd.DataFrame], path: Path, title: str = "",
                  numerics: set[str] = frozenset()) -> None:
    """One heatmap per panel ({its title: a grid, rows x kernels}), sized to the cells present (`compact`): a MAL panel
    coloured from 1 up, a speedup panel diverging around 1.0; numerics-only kernels marked * and hatched."""
    plt = _pyplot()
    from matplotlib.colors import Normalize, TwoSlopeNorm

    grids = {name: compact(g, numerics) for name, g in panels.items()}
    label = max((len(str(r)) for g in grids.values() for r in g.index), default=4)
    column = max((len(str(c)) for g in grids.values() for c in g.columns), default=4)
    widths = [1.6 + 0.07 * label + 1.0 * max(1, len(g.columns)) for g in grids.values()]
    size = (sum(widths), 1.6 + 0.06 * column + 0.45 * max(1, *(len(g.index) for g in grids.values())))
    fig, axes = plt.subplots(1, len(grids), figsize=size, squeeze=False, constrained_layout=True,
                             gridspec_kw={"width_ratios": widths})
    for ax, (name, g) in zip(axes[0], grids.items()):
        values = g.to_numpy(dtype=float)
        finite = values[np.isfinite(values)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 1.0)
        norm, cmap = ((Normalize(1.0, max(2.0, hi)), "viridis") if name.startswith("MAL")
                      else (TwoSlopeNorm(1.0, min(0.5, lo), max(1.5, hi)), "RdYlGn"))
        image = ax.imshow(values, cmap=cmap, norm=norm, aspect="auto")
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                dark = sum(image.cmap(image.norm(v))[:3]) < 1.5
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9, color="white" if dark else "black")
        for j, kernel in enumerate(g.columns):
            if kernel in numerics:
                ax.add_patch(plt.Rectangle((j - 0.5, -0.5), 1, len(g.index), fill=False, hatch="//", alpha=0.4))
        ax.set_xticks(range(len(g.columns)), [f"{c} *" if c in numerics else str(c) for c in g.columns],
                      rotation=30, ha="right", fontsize=8) if list(g.columns) != [""] else ax.set_xticks([])
        ax.set_yticks(range(len(g.index)), list(g.index), fontsize=8)
        ax.set_title(_wrapped(name, 0.6 + 1.0 * len(g.columns)), fontsize=9)  # about the axes' own width
        fig.colorbar(image, ax=ax, shrink=0.8)
    shown = {c for g in panels.values() for c in g.columns}
    note = "* numerics only: fp32 cost, read MAL only" if numerics & shown else ""
    if title or note:
        fig.suptitle(_wrapped(title, size[0]) + ("\n" + note if note else ""), fontsize=9)
    _save(fig, path)


def plot_acceptance(curves: dict[str, list[tuple[str, list[float], bool]]], title: str, path: Path) -> None:
    """Acceptance per draft position: one panel per drafter ({drafter: [(label, rates, numerics only)]}),
    one line per shape x kernel (numerics-only lines faded)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    width = max(4.6 * len(curves), 5.0)
    fig, axes = plt.subplots(1, len(curves), figsize=(width, 3.8), squeeze=False, sharey=True, constrained_layout=True)
    for ax, (drafter, lines) in zip(axes[0], sorted(curves.items())):
        for k, (label, rates, numerics) in enumerate(lines):
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, label=label + (" (numerics only)" if numerics else ""),
                        alpha=0.6 if numerics else 1.0, **kernel_style(k))
        ax.set(title=drafter, xlabel="draft position", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("P(accepted | earlier positions were)")
    fig.suptitle(_wrapped(title, width, 10), fontsize=10)
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
    """Held-out predictions of speculation against measurement, one marker per kind, hollow for those
    not scored (numerics-only cells, the A/A twin, own curves); the constant null is the horizontal line 1.0."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.6), constrained_layout=True)
    values = frame[["measured", "predicted", "flat"]].to_numpy(float) if len(frame) else np.ones((1, 3))
    lo, hi = min(0.5, float(values.min()) * 0.9), max(1.6, float(values.max()) * 1.1)
    xs = np.linspace(lo, hi, 2)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs / 1.25, xs * 1.25, color="grey", alpha=0.15, label="within 25%")
    ax.axhline(1.0, color="C7", lw=0.8, ls=":", label="constant null (1.0x)")
    for k, (kind, part) in enumerate(frame.groupby("kind", sort=True) if len(frame) else []):
        for numerics, sub in part.groupby(~part.scored if "scored" in part else part.numerics_only):
            ax.scatter(sub.measured, sub.predicted, s=26, marker=MARKERS[k], color=f"C{k}",
                       facecolors="none" if numerics else f"C{k}",
                       label=f"held-out {kind}" + (" (not scored)" if numerics else ""))
            ax.scatter(sub.measured, sub.flat, s=14, marker=MARKERS[k], color="C7", alpha=0.5,
                       label=f"flat-curve null, {kind}" if not numerics else None)
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured speculation speedup", ylabel="predicted (held out)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_decomposition(frame: pd.DataFrame, path: Path) -> None:
    """Per cell (rows of `frame`, factors as columns), the log of each factor of the interaction stacked
    from 0 (below for < 1, above for > 1) and the interaction's log as a black tick: the bars sum to it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 1.6 + 0.4 * max(1, len(frame))), constrained_layout=True)
    logs = np.log(frame.drop(columns="interaction").to_numpy(float))  # [cells, factors]
    for sign in (1, -1):
        base = np.zeros(len(frame))
        for j, name in enumerate(frame.columns.drop("interaction")):
            part = np.where(sign * logs[:, j] > 0, logs[:, j], 0.0)
            ax.barh(range(len(frame)), part, left=base, color=f"C{j}", label=name if sign > 0 else None)
            base += part
    ax.plot(np.log(frame.interaction.to_numpy(float)), range(len(frame)), "k|", ms=18, mew=2, label="interaction")
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(range(len(frame)), list(frame.index), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("log factor (the bars of a cell add up to the log interaction)")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.08))
    _save(fig, path)
