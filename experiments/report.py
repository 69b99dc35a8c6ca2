"""The findings report: does quantization compound with speculative decoding, or fight it, here?

    python scripts/report.py RESULTS [--project-device H200] [--project-curve FILE ...]

Owns the reading of a results store into cells (rows + the latency curves each cell stored), the
verdict per drafter x shape x kernel that the bootstrap intervals support, the cost model's
predicted-vs-measured comparison (`specdec.measure.costmodel`), optional projections to other hardware, and
REPORT.md with its PNGs (latency curve per kernel, compound-speedup heatmap, predicted vs measured).
Everything comes from the store: the same store gives the same REPORT.md, byte for byte (fixed
bootstrap seed, sorted cells, no timestamps). Knows nothing about how cells were measured beyond the
row and metadata fields the runner writes.

Verdict of a drafter x shape on a packed kernel k (a real low-bit or low-precision kernel), from the
speculation speedups s_k (on k) and s_0 (on the unquantized reference), paired over questions:
- *fight*: s_k / s_0 is below 1 (95% CI): speculation gains less on the quantized kernel;
- *compound*: s_k is above 1 and s_k / s_0 is not below 1: the gains multiply;
- *no significant effect*: neither is supported by the intervals.
"Numerics only" rows (weights stored dequantized: rtn, gptqref) say only how acceptance changes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.leaderboard import _SUMS, SETTING, SPEEDUPS, _stats, entry_stats
from experiments.store import load_rows, open_existing
from specdec.measure import costmodel
from specdec.measure.latency import LatencyCurve

SEED = 0
REFERENCE = "none"
CAVEATS = [
    "The embedded SmolLM2-135M weights come from a GGUF Q4_1 file (4 bits, groups of 32): 4-bit g32 "
    "kernels (torchao_int4_g32) land on nearly the same grid and lose almost nothing; rtn/gptqref use g64.",
    "CPU, not GPU: one torch thread on a shared 2-core machine (other jobs may have run alongside); "
    "the mechanism (verify-width cost per kernel) differs on GPUs, see the projections.",
    "RTN and gptqref rows are numerics only: weights stored dequantized, fp32 cost; their speedups are "
    "fp32's and only their acceptance (MAL) says something about the bit-width.",
]


class ReportError(ValueError):
    """A store the report cannot use (cells without latency curves, no reference cells, ...)."""


@dataclass
class Cell:
    """One stored cell: its labels, rows and stored metadata."""

    cell_id: str
    labels: dict
    rows: pd.DataFrame
    meta: dict
    stats: dict = field(default_factory=dict)

    @property
    def entry(self) -> tuple[str, str]:
        return self.labels["drafter"], self.labels["shape"]

    @property
    def quant(self) -> str:
        return self.labels["quant"]

    def curves(self) -> tuple[LatencyCurve, LatencyCurve]:
        """(target, reference) latency curves stored with the cell."""
        latency = self.meta["latency"]
        target = LatencyCurve.from_json(latency["target"], f"cell {self.cell_id} target curve")
        reference = latency.get("reference")
        return target, (LatencyCurve.from_json(reference, f"cell {self.cell_id} reference curve")
                        if reference is not None else target)

    def parts(self) -> tuple[costmodel.RunParts, costmodel.RunParts, costmodel.RunParts]:
        """(drafted, plain, reference) measured parts, summed over the cell's rows."""
        r = self.rows
        context = float((r.prompt_tokens + r.new_tokens / 2).mean())
        forwards: dict[int, int] = {}
        for widths in r.verify_widths:
            for w, n in widths.items():
                forwards[int(w)] = forwards.get(int(w), 0) + int(n)

        def plain(prefix: str) -> costmodel.RunParts:
            return costmodel.RunParts(
                new_tokens=int(r[f"{prefix}_new_tokens"].sum()), forwards={1: int(r[f"{prefix}_steps"].sum())},
                context=context, prefill_s=float(r[f"{prefix}_prefill_time_s"].sum()),
                other_s=float((r[f"{prefix}_wall_time_s"] - r[f"{prefix}_prefill_time_s"]
                               - r[f"{prefix}_verify_time_s"]).sum()))

        drafted = costmodel.RunParts(
            new_tokens=int(r.new_tokens.sum()), forwards=forwards, context=context,
            prefill_s=float(r.prefill_time_s.sum()),
            other_s=float((r.wall_time_s - r.prefill_time_s - r.verify_time_s).sum()))
        return drafted, plain("baseline"), plain("reference")


@dataclass
class Report:
    path: Path
    verdict: list[str]
    """At most 15 lines."""
    summary: dict
    """The JSON line: cells, cost_model, verdict."""


def load_cells(results: str | os.PathLike) -> list[Cell]:
    """Every finished cell of the store with its rows and metadata; ReportError naming the cells that
    lack what the report needs."""
    rows = load_rows(results)
    store = open_existing(results)
    cells, no_curve, old = [], [], []
    for cid, part in rows.groupby("cell_id", sort=True):
        meta = store.read_meta(cid)
        if "latency" not in meta:
            no_curve.append(cid)
        elif "verify_widths" not in part or "reference_wall_time_s" not in part:
            old.append(cid)
        else:
            cells.append(Cell(cid, meta.get("labels", {}) or part.iloc[0].to_dict(), part.reset_index(drop=True), meta))
    if no_curve or old:
        names = ", ".join((no_curve + old)[:6]) + (", ..." if len(no_curve + old) > 6 else "")
        raise ReportError(
            f"{len(no_curve + old)} cell(s) of {results} lack the latency curves or the reference run the report needs "
            f"({names}): they were written by an older runner. Rerun them with this one into a new results.dir "
            "(python -m experiments.run -m ... results.dir=NEW, or python -m experiments.main results.dir=NEW); "
            "each cell then stores its target's latency curve (runner.latency_widths / latency_contexts)")
    settings = {tuple(str(part[k].iloc[0]) for k in SETTING) for _, part in rows.groupby("cell_id")}
    if len(settings) > 1:
        raise ReportError(f"{results} holds {len(settings)} settings ({', '.join(SETTING)} differ between cells); the "
                          "report compares cells of one setting: give each setting its own results.dir")
    for cell in cells:
        cell.labels = {**cell.rows.iloc[0][["drafter", "shape", "quant", "bits", "model", "dataset", "prompts",
                                            "temperature", "max_new_tokens"]].to_dict(),
                       "numerics_only": bool(cell.rows.get("numerics_only", pd.Series([False])).iloc[0])}
        cell.stats = entry_stats(cell.rows, 0, np.random.default_rng(SEED))
    return cells


# ---- statistics ------------------------------------------------------------------------------------


def _paired(a: Cell, b: Cell, metric: str, n_boot: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """metric(a) / metric(b) with a 95% bootstrap CI, questions resampled jointly (shared questions only)."""
    qa, qb = (c.rows.groupby("question_id")[_SUMS].sum() for c in (a, b))
    shared = sorted(set(qa.index) & set(qb.index))
    if not shared:
        return float("nan"), float("nan"), float("nan")
    xa, xb = qa.loc[shared].to_numpy(float), qb.loc[shared].to_numpy(float)  # [Q, 8]
    point = _stats(xa.sum(0))[metric] / _stats(xb.sum(0))[metric]
    idx = rng.integers(0, len(shared), size=(n_boot, len(shared)))  # [B, Q]
    boot = _stats(xa[idx].sum(1))[metric] / _stats(xb[idx].sum(1))[metric]
    return float(point), float(np.nanpercentile(boot, 2.5)), float(np.nanpercentile(boot, 97.5))


def _ci(stats: dict, key: str) -> str:
    return f"{stats[key]:.2f}x [{stats[key + '_lo']:.2f}, {stats[key + '_hi']:.2f}]"


def classify(spec_k: tuple[float, float, float], ratio: tuple[float, float, float]) -> str:
    """compound / fight / no significant effect from (point, lo, hi) of s_k and of s_k / s_0."""
    if ratio[2] < 1.0:
        return "fight"
    if spec_k[1] > 1.0:
        return "compound"
    return "no significant effect"


def verdicts(cells: list[Cell], n_boot: int) -> dict[tuple[str, str], dict[str, dict]]:
    """{(drafter, shape): {kernel: {label, s_k, s_0, ratio, compound, quant}}} for every packed kernel
    with a reference cell of the same drafter x shape and setting."""
    rng = np.random.default_rng(SEED)
    out: dict[tuple[str, str], dict[str, dict]] = {}
    by_key = {(c.entry, c.quant): c for c in cells}
    for cell in cells:
        if cell.quant == REFERENCE or cell.labels["numerics_only"]:
            continue
        base = by_key.get((cell.entry, REFERENCE))
        if base is None:
            continue
        ratio = _paired(cell, base, "speedup", n_boot, rng)
        s_k = (cell.stats["speedup"], cell.stats["speedup_lo"], cell.stats["speedup_hi"])
        out.setdefault(cell.entry, {})[cell.quant] = {
            "label": classify(s_k, ratio), "s_k": s_k,
            "s_0": (base.stats["speedup"], base.stats["speedup_lo"], base.stats["speedup_hi"]), "ratio": ratio,
            "compound": (cell.stats["speedup_compound"], cell.stats["speedup_compound_lo"],
                         cell.stats["speedup_compound_hi"]),
            "quant": (cell.stats["speedup_quant"], cell.stats["speedup_quant_lo"], cell.stats["speedup_quant_hi"]),
        }
    return out


def _fmt(triple: tuple[float, float, float]) -> str:
    return f"{triple[0]:.2f}x [{triple[1]:.2f}, {triple[2]:.2f}]"


# ---- cost model ------------------------------------------------------------------------------------


def cost_model_table(cells: list[Cell], projections: dict[str, dict[str, LatencyCurve]]) -> pd.DataFrame:
    """Per cell: measured and predicted speedups (and projected ones per projection name)."""
    records = []
    for cell in cells:
        drafted, plain, reference = cell.parts()
        target_curve, reference_curve = cell.curves()
        pred = costmodel.predict(drafted, plain, reference, target_curve, reference_curve)
        record = {"cell_id": cell.cell_id, "drafter": cell.entry[0], "shape": cell.entry[1], "quant": cell.quant,
                  "numerics_only": cell.labels["numerics_only"], "mal": cell.stats["mal"],
                  **{f"measured_{k}": cell.stats[k] for k in SPEEDUPS},
                  **{f"predicted_{k}": getattr(pred, k) for k in SPEEDUPS}}
        for name, curves in projections.items():
            pair = (curves.get(target_curve.target), curves.get(reference_curve.target))
            if pair[0] is None or pair[1] is None:
                continue
            proj = costmodel.project(drafted, plain, reference, (target_curve, reference_curve), pair)
            record[f"{name}_speedup"] = proj.speedup
            record[f"{name}_speedup_compound"] = proj.speedup_compound
        records.append(record)
    table = pd.DataFrame(records)
    table["relative_error"] = (table.predicted_speedup_compound / table.measured_speedup_compound - 1).abs()
    return table


def projection_curves(cells: list[Cell], devices: list[str], curve_files: list[str]) -> dict[str, dict[str, LatencyCurve]]:
    """{projection name: {target label: curve}} from roofline devices and curve files."""
    out: dict[str, dict[str, LatencyCurve]] = {}
    for name in devices:
        dev = costmodel.device(name)
        curves: dict[str, LatencyCurve] = {}
        for cell in cells:
            sizes = cell.meta.get("model_sizes", {})
            for role, curve in zip(("target", "reference"), cell.curves()):
                if curve.target not in curves and role in sizes:
                    curves[curve.target] = costmodel.roofline_curve(dev, sizes[role], curve.widths, curve.contexts,
                                                                    curve.target)
        out[f"roofline {dev.name}"] = curves
    if curve_files:
        files = [LatencyCurve.load(path) for path in curve_files]
        out["curve file " + ",".join(sorted({c.machine for c in files}))] = {c.target: c for c in files}
    return out


# ---- figures ---------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=100, metadata={"Software": None})
    _pyplot().close(fig)


def plot_latency(curves: dict[str, LatencyCurve], path: Path) -> None:
    """Forward time and its ratio to a 1-token forward, against width, one line per kernel."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    for label, curve in sorted(curves.items()):
        for context, row in zip(curve.contexts, curve.seconds):
            style = "-" if context == curve.contexts[0] else "--"
            axes[0].plot(curve.widths, [1e3 * s for s in row], style, marker="o", label=f"{label} c={context}")
            axes[1].plot(curve.widths, [s / row[0] for s in row], style, marker="o", label=f"{label} c={context}")
    axes[0].set(xscale="log", xlabel="forward width (tokens)", ylabel="ms per forward", title="latency curve")
    axes[1].set(xscale="log", xlabel="forward width (tokens)", ylabel="x one-token forward",
                title="cost of a wide verify, per kernel")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    _save(fig, path)


def plot_heatmap(cells: list[Cell], path: Path) -> None:
    """Compound speedup (drafted on the kernel / fp32 plain), drafter x shape vs kernel."""
    plt = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    entries = sorted({c.entry for c in cells})
    quants = sorted({c.quant for c in cells}, key=lambda q: (q != REFERENCE, q))
    grid = np.full((len(entries), len(quants)), np.nan)
    for c in cells:
        grid[entries.index(c.entry), quants.index(c.quant)] = c.stats["speedup_compound"]
    fig, ax = plt.subplots(figsize=(2.2 + 1.4 * len(quants), 1.2 + 0.5 * len(entries)), constrained_layout=True)
    vmax = max(1.5, float(np.nanmax(grid)))
    image = ax.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(1.0, min(0.5, float(np.nanmin(grid))), vmax),
                      aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
    numerics = {c.quant for c in cells if c.labels["numerics_only"]}
    ax.set_xticks(range(len(quants)), [q + ("*" if q in numerics else "") for q in quants], rotation=20,
                  ha="right", fontsize=8)
    ax.set_yticks(range(len(entries)), [f"{d} {s}" for d, s in entries], fontsize=8)
    ax.set_title("compound speedup over fp32 plain decoding (* numerics only)", fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8)
    _save(fig, path)


def plot_predicted(table: pd.DataFrame, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 4.2), constrained_layout=True)
    hi = max(1.6, float(table[["measured_speedup_compound", "predicted_speedup_compound"]].max().max()) * 1.1)
    xs = np.linspace(0, hi, 2)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs / 1.25, xs * 1.25, color="grey", alpha=0.15, label="within 25%")
    for i, (quant, part) in enumerate(table.groupby("quant", sort=True)):
        ax.scatter(part.measured_speedup_compound, part.predicted_speedup_compound, color=f"C{i}", label=quant, s=24)
    ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="measured compound speedup", ylabel="predicted (cost model)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


# ---- the report ------------------------------------------------------------------------------------


def _setting_lines(cells: list[Cell]) -> list[str]:
    first = cells[0]
    machines = sorted({c.meta.get("hardware", {}).get("cpu", "?") for c in cells})
    threads = sorted({str(c.meta.get("hardware", {}).get("torch_threads", "?")) for c in cells})
    torch_versions = sorted({str(c.meta.get("versions", {}).get("torch")) for c in cells})
    prompts = sorted({int(c.stats["questions"]) for c in cells})
    return [f"- model `{first.labels['model']}`, dataset `{first.labels['dataset']}` ({'/'.join(map(str, prompts))} "
            f"questions), {first.labels['max_new_tokens']} new tokens, T = {first.labels['temperature']:g}",
            f"- machine: {', '.join(machines)} (CPU), torch threads {', '.join(threads)}, torch {', '.join(torch_versions)}",
            f"- {len(cells)} cells; every number below is read from the results store"]


def build_report(results: str | os.PathLike, n_boot: int = 2000, devices: tuple[str, ...] = (),
                 curve_files: tuple[str, ...] = ()) -> tuple[str, list[str], dict, dict]:
    """(REPORT.md text, verdict lines, JSON summary, figures {file name: plotting thunk})."""
    cells = load_cells(results)
    rng = np.random.default_rng(SEED)
    for cell in cells:
        cell.stats = entry_stats(cell.rows, n_boot, rng)
    found = verdicts(cells, n_boot)
    table = cost_model_table(cells, projection_curves(cells, list(devices), list(curve_files)))
    within = float((table.relative_error <= 0.25).mean())
    median_error = float(table.relative_error.median())

    verdict = [f"Do quantization and speculative decoding compound here? ({len(cells)} cells, "
               f"{cells[0].labels['model']}, dataset {cells[0].labels['dataset']}, CPU)"]
    for entry, kernels in sorted(found.items()):
        parts = [f"{k}: {v['label']} (speculation {_fmt(v['s_k'])} vs {_fmt(v['s_0'])} on fp32; "
                 f"compound {_fmt(v['compound'])})" for k, v in sorted(kernels.items())]
        verdict.append(f"- {entry[0]} {entry[1]}: " + "; ".join(parts))
    if not found:
        verdict.append("- no drafter x shape has both a packed-kernel cell and an fp32 cell: no verdict")
    faster = [c for c in cells if not c.labels["numerics_only"] and c.stats["speedup_compound_lo"] > 1.0]
    spec_faster = [c for c in cells if c.stats["speedup_lo"] > 1.0]
    if not spec_faster:
        verdict.append("- No entry is reliably faster than plain decoding on its own target "
                       "(every speculation CI includes or lies below 1.0).")
    if faster:
        best = max(faster, key=lambda c: c.stats["speedup_compound"])
        verdict.append(f"- Fastest over fp32 plain: {best.entry[0]} {best.entry[1]} on {best.quant}, "
                       f"{_ci(best.stats, 'speedup_compound')}.")
    else:
        verdict.append("- No entry is reliably faster than fp32 plain decoding (every compound CI includes "
                       "or lies below 1.0).")
    numerics = [c for c in cells if c.labels["numerics_only"]]
    if numerics:
        mal = "; ".join(f"{c.entry[0]} {c.entry[1]} {c.quant} {c.stats['mal']:.2f} [{c.stats['mal_lo']:.2f}, "
                        f"{c.stats['mal_hi']:.2f}]" for c in sorted(numerics, key=lambda c: (c.entry, c.quant)))
        verdict.append(f"- Acceptance under numerics-only quantization (MAL): {mal}")
    verdict.append(f"- Cost model: predicted compound speedup within 25% for {within:.0%} of cells "
                   f"(median relative error {median_error:.1%}).")
    diverged = [c for c in cells if c.stats["same_tokens_as_baseline"] < 1.0]
    if diverged:
        kernels = ", ".join(sorted({c.quant for c in diverged}))
        verdict.append(f"- Token identity: {len(diverged)} of {len(cells)} cells ({kernels}) left the plain loop's "
                       f"output on the same kernel in some turns (rounding changes with verification width).")
    else:
        verdict.append("- Token identity: every cell reproduced the plain loop's output on its own kernel.")
    verdict.append("- Caveats: Q4_1-origin weights (4-bit g32 is near-lossless); CPU, not GPU; see REPORT.md.")
    verdict = verdict[:15]

    summary = {"cells": len(cells),
               "cost_model": {"median_relative_error": round(median_error, 4), "within_25pct": round(within, 4),
                              "speedup": "compound (drafted on the kernel / fp32 plain)"},
               "verdict": {f"{d} {s}": {k: v["label"] for k, v in sorted(ks.items())} for (d, s), ks in sorted(found.items())}}

    curves: dict[str, LatencyCurve] = {}
    for cell in cells:
        for curve in cell.curves():
            curves.setdefault(curve.target, curve)

    md = ["# Do quantization and speculative decoding compound or fight? Findings on this machine", "",
          "## Verdict", "", *verdict, "", "## Setting and caveats", "", *_setting_lines(cells),
          *[f"- {c}" for c in CAVEATS], "",
          "## The mechanism: what a wide forward costs on each kernel", "",
          "Measured latency curves stored with the cells (median of repeats; `ms` at the smallest context, "
          "and the cost of a forward of w tokens in one-token forwards). A draft of n nodes is verified by a "
          "forward of width n + 1.", "", "![latency](latency.png)", "",
          "| kernel | machine | 1 token (ms) | " + " | ".join(f"w={w}" for w in (2, 4, 8, 16, 32)) + " |",
          "|---|---|---:|" + "---:|" * 5]
    for label, curve in sorted(curves.items()):
        md.append(f"| {label} | {curve.machine} | {1e3 * curve.at(1):.1f} | "
                  + " | ".join(f"{curve.ratio(w):.2f}x" for w in (2, 4, 8, 16, 32)) + " |")
    md += ["", "## Three speedups per cell (measured)", "",
           "Speculation = drafted / plain on the same target; quantization = plain on the kernel / fp32 plain; "
           "compound = drafted on the kernel / fp32 plain, measured directly (runs side by side, order rotated). "
           "95% bootstrap CI over questions. Same tokens = the share of turns whose drafted output equals the plain "
           "loop's on the same target. The verifier is exact for the logits it computes, so in exact arithmetic it "
           "is 100%. A kernel whose rounding depends on the forward's width (bf16, int4 here; fp32 on some "
           "kernels) can flip a near-tie between the plain loop's one-token forwards and the verification's "
           "wider one, and from there the two outputs differ.", "",
           "| drafter | shape | kernel | MAL | speculation | quantization | compound | same tokens |",
           "|---|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c.entry, c.quant != REFERENCE, c.quant)):
        kernel = c.quant + (" (numerics only)" if c.labels["numerics_only"] else "")
        md.append(f"| {c.entry[0]} | `{c.entry[1]}` | {kernel} | {c.stats['mal']:.2f} [{c.stats['mal_lo']:.2f}, "
                  f"{c.stats['mal_hi']:.2f}] | {_ci(c.stats, 'speedup')} | {_ci(c.stats, 'speedup_quant')} | "
                  f"{_ci(c.stats, 'speedup_compound')} | {c.stats['same_tokens_as_baseline']:.0%} |")
    md += ["", "![compound](compound_heatmap.png)", "",
           "## Verdict per drafter x shape x kernel", "",
           "s_k = speculation speedup on the kernel, s_0 = on fp32; ratio = s_k / s_0 (paired bootstrap over "
           "questions). fight: ratio CI below 1; compound: s_k CI above 1 and ratio not below 1; else no "
           "significant effect.", "",
           "| drafter | shape | kernel | verdict | s_k | s_0 | s_k / s_0 | quantization | compound |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (d, s), kernels in sorted(found.items()):
        for k, v in sorted(kernels.items()):
            md.append(f"| {d} | `{s}` | {k} | **{v['label']}** | {_fmt(v['s_k'])} | {_fmt(v['s_0'])} | "
                      f"{_fmt(v['ratio'])} | {_fmt(v['quant'])} | {_fmt(v['compound'])} |")
    md += ["", "## Cost model: predicted vs measured", "",
           "Measured: MAL and steps per verify width, prefill, drafting and other non-forward time, the latency "
           "curves. Predicted: every target forward, costed by the curve at its width and the run's mean context, "
           "and hence the speedups (`specdec/measure/costmodel.py`).", "",
           f"Compound speedup within 25%: **{within:.0%}** of cells; median relative error **{median_error:.1%}**.", "",
           "![predicted](predicted_vs_measured.png)", "",
           "| drafter | shape | kernel | measured speculation | predicted | measured compound | predicted | error |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for _, r in table.sort_values(["drafter", "shape", "quant"]).iterrows():
        md.append(f"| {r.drafter} | `{r['shape']}` | {r.quant} | {r.measured_speedup:.2f}x | {r.predicted_speedup:.2f}x "
                  f"| {r.measured_speedup_compound:.2f}x | {r.predicted_speedup_compound:.2f}x | {r.relative_error:.0%} |")
    projected = sorted({c.rsplit("_speedup", 1)[0] for c in table.columns
                        if c.endswith("_speedup") and not c.startswith(("measured", "predicted"))})
    if projected:
        md += ["", "## Projected to other hardware (projected, not measured)", "",
               "Forward times from the projection's curves (roofline: weight + KV bytes over bandwidth, FLOPs over "
               "peak, plus a per-forward overhead, `specdec.measure.costmodel.DEVICES`); measured non-forward times scaled "
               "by the ratio of one-token forward times; MAL as measured here.", "",
               "| drafter | shape | kernel | " + " | ".join(f"{p}: speculation / compound" for p in projected) + " |",
               "|---|---|---|" + "---|" * len(projected)]
        for _, r in table.sort_values(["drafter", "shape", "quant"]).iterrows():
            values = [f"{r[f'{p}_speedup']:.2f}x / {r[f'{p}_speedup_compound']:.2f}x"
                      if pd.notna(r.get(f"{p}_speedup")) else "" for p in projected]
            md.append(f"| {r.drafter} | `{r['shape']}` | {r.quant} | " + " | ".join(values) + " |")
    md += ["", "## Acceptance per depth (measured)", "",
           "| drafter | shape | kernel | P(accepted path reaches d \\| draft did), d = 1, 2, ... |", "|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c.entry, c.quant)):
        reached = np.zeros(0)
        accepted = np.zeros(0)
        for r_, a_ in zip(c.rows.reached_by_depth, c.rows.accepted_by_depth):
            n = max(len(reached), len(r_))
            reached, accepted = np.pad(reached, (0, n - len(reached))), np.pad(accepted, (0, n - len(accepted)))
            reached[: len(r_)] += r_
            accepted[: len(a_)] += a_
        rates = ", ".join(f"{a / r:.2f}" for a, r in zip(accepted, reached) if r)
        md.append(f"| {c.entry[0]} | `{c.entry[1]}` | {c.quant} | {rates} |")
    md.append("")

    figures = {"latency.png": lambda p: plot_latency(curves, p),
               "compound_heatmap.png": lambda p: plot_heatmap(cells, p),
               "predicted_vs_measured.png": lambda p: plot_predicted(table, p)}
    return "\n".join(md), verdict, summary, figures


def write_report(results: str | os.PathLike, n_boot: int = 2000, devices: tuple[str, ...] = (),
                 curve_files: tuple[str, ...] = ()) -> Report:
    """Write RESULTS/REPORT.md and its PNGs; returns the path, the verdict lines and the JSON summary."""
    markdown, verdict, summary, figures = build_report(results, n_boot, devices, curve_files)
    root = Path(results)
    for name, draw in figures.items():
        draw(root / name)
    path = root / "REPORT.md"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(markdown, encoding="utf-8")
    os.replace(tmp, path)
    return Report(path=path, verdict=verdict, summary=summary)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from experiments.leaderboard import LeaderboardError
    from experiments.store import StoreError

    parser = argparse.ArgumentParser(description="Write RESULTS/REPORT.md and PNGs; print the verdict and a JSON line.")
    parser.add_argument("results", help="a results store directory")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (fixed seed)")
    parser.add_argument("--project-device", action="append", default=[], metavar="NAME",
                        help=f"project to a known device by roofline ({', '.join(costmodel.DEVICES)})")
    parser.add_argument("--project-curve", action="append", default=[], metavar="FILE",
                        help="project with a latency curve file (specdec.measure.latency JSON) measured on other hardware")
    args = parser.parse_args(argv)
    try:
        report = write_report(args.results, args.bootstrap, tuple(args.project_device), tuple(args.project_curve))
    except (ReportError, StoreError, LeaderboardError, ValueError, OSError) as err:
        print(f"report: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(report.verdict))
    print(f"wrote {report.path} and its PNGs", file=sys.stderr)
    print(json.dumps(report.summary))
    return 0
