"""The findings report: does quantization compound with speculative decoding, or fight it, here?

    python -m experiments.report RESULTS [--project-device H200=h200_curve.json] [--project-curve FILE ...]

Owns, over a store's cells (`experiments.stored`), the verdict lines (`experiments.verdict`), the cost-model score
and projections (`experiments.costs`), acceptance apart from cost, and REPORT.md with its PNGs (`experiments.figures`).
The same store gives the same REPORT.md byte for byte. "Numerics only" rows get no speed verdict and sit apart in
every table. Knows nothing about how cells were measured beyond the fields the runner writes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from experiments import costs, figures, kv
from experiments.predict import mechanism_control, predictions, text
from experiments.batches import batch_section
from experiments.costs import md_table
from experiments.leaderboard import N_BOOT, LeaderboardError, atomic_text, position_rates
from experiments.store import StoreError
from experiments.stored import Cell, ReportError, cell_order, load_cells, verdicts  # noqa: F401 -- the report's error
from experiments.verdict import MARGIN, Interaction, drift, job_drift
from specdec.core.curve import LatencyCurve
from specdec.measure import costmodel

REFERENCE = "none"
RULES = ("Per prompt, the interaction = (speculation speedup on the kernel) / (on fp32), from four runs back to back "
         "in rotating order (fp32 plain, fp32 drafted, kernel plain, kernel drafted); geometric mean over prompts, 95% "
         "bootstrap CI over prompts. **fight**: CI wholly below 1; **compound**: CI lower end >= {margin} and not a "
         "fight; otherwise **inconclusive**, with the prompts the CI's width says would settle it. The A/A control "
         "(fp32 measured again under another label) has a true interaction of 1 and must read compound. Numerics-only "
         "kernels run at fp32 cost: no speed verdict.")
SPEEDUPS_TEXT = (
    "Speculation = drafted / plain on the same kernel; quantization = plain on the kernel / fp32 plain; compound "
    "= drafted on the kernel / fp32 plain (pooled tokens/s, 95% bootstrap CI over prompts, drawn once per cell and "
    "stored with it: the cell's console line and the leaderboard print the same). fp32 plain tok/s: median [min, "
    "max] over the cell's prompts (the drift of the baseline within and across cells). Same tokens = the share of "
    "turns whose drafted output equals the plain loop's on the same kernel (a kernel whose rounding depends on the "
    "forward's width can flip near-ties).")
ACCEPTANCE_TEXT = (
    "Free-running MAL on the kernel and on fp32 (same prompts, paired runs); teacher-forced MAL: the drafter's "
    "drafts along the fp32 plain continuation judged by the kernel's argmax after each prefix of that same text, so "
    "every kernel is scored on one text; same text: the share of prompts whose plain output on the kernel equals "
    "fp32's. A gap between free-running and teacher-forced acceptance is the text confound.")
POSITIONS_TEXT = (
    "Per draft position i, the acceptance rate given positions 1 .. i-1 were accepted (pooled over the cell's "
    "steps: the rate published tables quote), and the share of steps that accepted k draft tokens (each request's "
    "own histogram is in its rows, `accept_histogram`; the leaderboard's spec_bench/ files give Spec-Bench's "
    "`accept_lengths`).")


DECOMPOSITION_TEXT = (
    "Per prompt, speculation's decode-only speedup is s = M / (R + d): M tokens per verify step (over the plain "
    "run's), R a verify step's seconds (drafting excluded) in plain decode steps of the same kernel, d the rest of a "
    "drafted step (drafting) in the same unit, all from the runs' step times. The interaction is acceptance (M on "
    "the kernel over M on fp32) x width (R) x drafting (d), split by Shapley, x prefill (end-to-end over "
    "decode-only): geometric means over prompts on the verdict's own bootstrap draws, so the four factors multiply "
    "to the interaction. R(w) is in-run, at the cell's verify widths.")
FACTOR_NAMES = ("mal", "width", "drafting", "prefill")


@dataclass
class Report:
    path: Path
    verdict: list[str]
    """At most 15 lines."""
    summary: dict
    """The JSON line: cells, control, verdict, cost_model, drift, curves (`costs.curve_fit_summary`), kv."""


# ---- verdicts, acceptance ---------------------------------------------------------------------------


def _ci(stats: dict, key: str, unit: str = "x") -> str:
    return f"{stats[key]:.2f}{unit} [{stats[key + '_lo']:.2f}, {stats[key + '_hi']:.2f}]"


def acceptance_table(cells: list[Cell]) -> pd.DataFrame:
    """Per cell: free-running MAL on the kernel and on fp32 (same prompts), teacher-forced MAL on the
    fp32 text, and the share of prompts whose plain text equals fp32's."""
    records = []
    for c in cells:
        r = c.rows
        same = r.groupby("question_id").same_tokens_as_reference.all() if "same_tokens_as_reference" in r else None
        tf = (float(r.new_tokens.sum() / (r.new_tokens / r.tf_mal).sum())  # pooled: tokens / implied steps
              if "tf_mal" in r and r.tf_mal.notna().all() else np.nan)
        fp32 = 1 + r.reference_drafted_accepted_tokens.sum() / r.reference_drafted_steps.sum()
        records.append({"name": c.name, "quant": c.quant, "numerics_only": c.numerics_only, "mal": c.stats["mal"],
                        "fp32_mal": fp32, "tf_mal": tf,
                        "same_text": float(same.mean()) if same is not None else np.nan})
    return pd.DataFrame(records)


# ---- the report ------------------------------------------------------------------------------------


def _limits(cells: list[Cell]) -> str:
    """The limits line, from what the store recorded: the model's size and source, the device and its
    threads, and (with quantized cells) the text confound."""
    meta, hardware = cells[0].meta, [c.meta.get("hardware", {}) for c in cells]
    params = meta.get("model_sizes", {}).get("target", {}).get("params")
    parts = [f"a {params / 1e6:.0f}M-parameter model ({cells[0].labels['model']})" if params
             else f"model {cells[0].labels['model']}"]
    threads = "/".join(sorted({str(h.get("torch_threads", "?")) for h in hardware}))
    parts.append(f"on {'GPU' if any(h.get('cuda') for h in hardware) else 'CPU'} ({threads} torch thread(s))")
    gguf = re.search(r"\.(Q(\d)_\w+)\.gguf$", str(meta.get("target_info", {}).get("source", "")))
    if gguf:
        parts.append(f"weights from a {gguf[1]} GGUF (so {gguf[2]}-bit requantization is near-lossless)")
    if any(c.quant != REFERENCE and not c.control for c in cells):
        parts.append("quantized targets write different text (so free-running acceptance mixes 'bits change "
                     "acceptance' with 'bits change the text')")
    return "Limits: " + ", ".join(parts) + "."


def _setting_lines(cells: list[Cell]) -> list[str]:
    first = cells[0]
    machines = sorted({c.meta.get("hardware", {}).get("cpu", "?") for c in cells})
    threads = sorted({str(c.meta.get("hardware", {}).get("torch_threads", "?")) for c in cells})
    torch_versions = sorted({str(c.meta.get("versions", {}).get("torch")) for c in cells})
    prompts = sorted({int(c.stats["questions"]) for c in cells})
    return [f"- model `{first.labels['model']}`, dataset `{first.labels['dataset']}` ({'/'.join(map(str, prompts))} "
            f"questions), {first.labels['max_new_tokens']} new tokens, T = {first.labels['temperature']:g}",
            f"- machine: {', '.join(machines)}, torch threads {', '.join(threads)}, torch {', '.join(torch_versions)}",
            f"- {len(cells)} cells; every number below is read from the results store"]


def _verdict(cells: list[Cell], found: dict[str, Interaction], accept: pd.DataFrame, score: dict,
             spread: float, batches: int) -> list[str]:
    """The verdict's lines before the KV question's: each line with a target says whether it is met."""
    first = cells[0]
    lines = [f"Do quantization and speculative decoding compound here? ({len(cells)} cells, {first.labels['model']}, "
             f"dataset {first.labels['dataset']}, {int(first.stats['questions'])} prompts x "
             f"{first.labels['max_new_tokens']} tokens)", f"- {_limits(cells)}"]
    controls = [c for c in cells if c.control and c.cell_id in found]
    for c in controls:
        met = found[c.cell_id].label == "compound"
        lines.append(f"- A/A control ({c.name}, fp32 measured again), target compound {'met' if met else 'NOT met'}: "
                     f"{found[c.cell_id].text()}" + ("" if met else " -- distrust the verdicts below"))
    if not controls:
        lines.append("- A/A control: none in this store (quant=fp32_again), so the rules below are unchecked")
    for c in _speed(cells, found):
        v = found[c.cell_id]
        same = (f"; drafted text = the kernel's own plain text on {v.factors['same_text']:.0%} of prompts (interaction "
                f"{v.factors['same_text_interaction']:.2f} on those)" if v.factors else "")
        lines.append(f"- {c.name}: {v.text()}; compound {_ci(c.stats, 'speedup_compound')}{same}")
    real = [c for c in cells if not c.numerics_only]
    best = max(real, key=lambda c: c.stats["speedup_compound"]) if real else None
    if best is not None and best.stats["speedup_compound_lo"] > 1.0:
        lines.append(f"- Fastest over fp32 plain: {best.name}, {_ci(best.stats, 'speedup_compound')}.")
    else:
        lines.append("- No entry is reliably faster than fp32 plain decoding (every compound CI includes or lies "
                     "below 1.0).")
    kernels = accept[~accept.numerics_only & (accept.quant != REFERENCE)]
    if len(kernels):
        lines.append("- Same plain text as fp32: " + "; ".join(
            f"{q} {s:.0%}" for q, s in kernels.groupby("quant").same_text.mean().items() if np.isfinite(s))
            + " of prompts (numerics-only in REPORT.md)")
    lines += costs.verdict_line(score)
    lines.append(f"- Drift: fp32 plain tok/s per cell (median) spans {spread:.0%} of its median across the job"
                 + (" (the most within one batch size)" if batches > 1 else ""))
    return lines


def _speed(cells: list[Cell], found: dict[str, Interaction]) -> list[Cell]:
    """Cells with a speed verdict: on a real kernel, not the A/A control."""
    return [c for c in cells if c.cell_id in found and not c.numerics_only and not c.control]


def _summary(cells: list[Cell], found: dict[str, Interaction], score: dict, spread: float, fit: pd.DataFrame,
             kv_summary: dict | None) -> dict:
    """The JSON line."""
    control = next((found[c.cell_id].label for c in cells if c.control and c.cell_id in found
                    and found[c.cell_id].label != "compound"), "compound")
    shown = _speed(cells, found) + [c for c in cells if c.control]
    curves_fit = costs.curve_fit_summary(fit)  # {} without a batch-1 cell
    return {"cells": len(cells), "control": control if any(c.control and c.cell_id in found for c in cells) else None,
            "verdict": {c.name: found[c.cell_id].label for c in _speed(cells, found)},
            "interaction": {c.name: [round(v, 4) for v in (found[c.cell_id].point, found[c.cell_id].lo,
                                                           found[c.cell_id].hi)] for c in shown},
            "decomposition": decomposition(cells, found), "cost_model": score, "drift": round(spread, 4),
            **({"curves": curves_fit} if curves_fit else {}), **({"kv": kv_summary} if kv_summary else {})}


def _rules_md(cells: list[Cell], found: dict[str, Interaction]) -> list[str]:
    """The rules and the table of interactions."""
    md = ["## Rules", "", RULES.format(margin=MARGIN), "", "![interactions](interactions.png)", ""]
    lines = []
    for c in (c for c in cells if c.cell_id in found):
        v = found[c.cell_id]
        kind = " (A/A control)" if c.control else " (numerics only)" if c.numerics_only else ""
        ci = f"{v.point:.2f} [{v.lo:.2f}, {v.hi:.2f}]"
        lines.append([f"{c.entry[0]}", f"`{c.entry[1]}`", c.quant + kind, f"**{v.label}**", ci, str(v.questions),
                      str(v.settle or ""), _ci(c.stats, "speedup"), _ci(c.stats, "speedup_compound")])
    return md + md_table(["drafter", "shape", "kernel", "verdict", "interaction", "prompts", "prompts to settle",
                          "speculation on kernel", "compound"], lines)


def decomposition(cells: list[Cell], found: dict[str, Interaction]) -> dict:
    """The JSON line's `decomposition` of the speed cells and the A/A control: {cell: {interaction, decode,
    mal, width, drafting, prefill, r_kernel, r_fp32, same_text, same_text_interaction, ci: {name: [lo, hi]}}}."""
    out = {}
    for c in _speed(cells, found) + [c for c in cells if c.control and found.get(c.cell_id)]:
        v = found[c.cell_id]
        if not v.factors:
            continue
        parts = {k: x for k, x in v.factors.items() if isinstance(x, tuple)} | {"interaction": (v.point, v.lo, v.hi)}
        out[c.name] = ({k: round(x[0], 4) for k, x in parts.items()}
                       | {k: round(v.factors[k], 4) for k in ("same_text", "same_text_interaction")}
                       | {"ci": {k: [round(x[1], 4), round(x[2], 4)] for k, x in parts.items()}})
    return out


def _decomposition_md(table: dict) -> list[str]:
    """Why each cell fights or compounds: the decomposition's table and stacked plot."""
    if not table:
        return []
    ci = lambda d, k: f"{d[k]:.3f} [{d['ci'][k][0]:.3f}, {d['ci'][k][1]:.3f}]"  # noqa: E731
    return ["", "## Why: the interaction decomposed", "", DECOMPOSITION_TEXT, "",
            "![decomposition](decomposition.png)", "", *md_table(
                ["cell", "interaction", "decode-only", "acceptance (MAL)", "width", "drafting", "prefill",
                 "R kernel", "R fp32", "drafted text = kernel plain", "interaction on those"],
                [[name, *(ci(d, k) for k in ("interaction", "decode", *FACTOR_NAMES, "r_kernel", "r_fp32")),
                  f"{d['same_text']:.0%}", f"{d['same_text_interaction']:.2f}"] for name, d in table.items()]), ""]


def _speedups_md(cells: list[Cell], drifts: dict[str, dict]) -> list[str]:
    """Three speedups per cell and the fp32 plain loop's drift, real kernels and numerics-only apart."""
    md = ["", "## Three speedups per cell, and drift", "", SPEEDUPS_TEXT, ""]
    numerics = "Numerics only (fp32 cost: speed columns are fp32's)"
    for title, group in (("Real kernels", [c for c in cells if not c.numerics_only]),
                         (numerics, [c for c in cells if c.numerics_only])):
        if group:
            md += [f"### {title}", "", *md_table(
                ["drafter", "shape", "kernel", "MAL", "speculation", "quantization", "compound", "fp32 plain tok/s",
                 "same tokens"],
                [[c.entry[0], f"`{c.entry[1]}`", c.quant, _ci(c.stats, "mal", ""), _ci(c.stats, "speedup"),
                  _ci(c.stats, "speedup_quant"), _ci(c.stats, "speedup_compound"),
                  "{median:.1f} [{min:.1f}, {max:.1f}]".format(**drifts[c.cell_id]),
                  f"{c.stats['same_tokens_as_baseline']:.0%}"] for c in group]), ""]
    return md


def _acceptance_md(cells: list[Cell], accept: pd.DataFrame) -> list[str]:
    """Acceptance apart from cost: free-running against teacher-forced, and per draft position."""
    md = ["## Acceptance apart from cost", "", ACCEPTANCE_TEXT, "", *md_table(
        ["cell", "MAL (kernel)", "MAL (fp32, same prompts)", "teacher-forced MAL", "same text as fp32"],
        [[r["name"] + (" (numerics only)" if r["numerics_only"] else ""), f"{r['mal']:.2f}", f"{r['fp32_mal']:.2f}",
          f"{r['tf_mal']:.2f}", f"{r['same_text']:.0%}"]
         for _, r in accept.sort_values(["numerics_only", "name"]).iterrows()])]
    positions = {c.name: position_rates(c.rows) for c in cells}
    if any(rates for rates, _ in positions.values()):
        md += ["", POSITIONS_TEXT, "", *md_table(
            ["cell", "acceptance at draft position 1, 2, ... (given the ones before accepted)",
             "steps accepting 0, 1, 2, ... draft tokens"],
            [[name, " / ".join(f"{r:.2f}" if np.isfinite(r) else "-" for r in rates),
              " / ".join(f"{h:.0%}" for h in hist)]
             for name, (rates, hist) in positions.items() if rates])]
    return md


def _mechanism_md(curves: dict[str, list[LatencyCurve]]) -> list[str]:
    """What a wide forward costs on each kernel, from the curves stored with the cells (the first cell's)."""
    return ["", "## The mechanism: what a wide forward costs on each kernel", "",
            "Latency curves stored with the cells (each the median of its repeats; the plot draws the median of "
            "every cell's curve of a kernel and their min..max as a band): ms of a one-token forward at the smallest "
            "context, and a forward of w tokens in one-token forwards (the first cell's curve).", "",
            "![latency](latency.png)", "", *md_table(
                ["kernel", "machine", "curves", "1 token (ms)", *(f"w={w}" for w in (2, 4, 8, 16, 32))],
                [[label, c[0].machine, str(len(c)), f"{1e3 * c[0].at(1):.1f}",
                  *(f"{c[0].ratio(w):.2f}x" for w in (2, 4, 8, 16, 32))]
                 for label, c in sorted(curves.items())])]


def _figures(cells: list[Cell], found: dict[str, Interaction], curves: dict[str, list[LatencyCurve]],
             held: pd.DataFrame, table: dict) -> dict:
    """{file name: plotting thunk} of REPORT.md's PNGs."""
    real = list(dict.fromkeys(c.quant for c in cells if not c.numerics_only))
    numerics = list(dict.fromkeys(c.quant for c in cells if c.numerics_only))
    entries = sorted({f"{d} {s}" for d, s in (c.entry for c in cells)})
    grid = pd.DataFrame(np.nan, index=entries, columns=real + numerics)
    for c in cells:
        grid.loc[f"{c.entry[0]} {c.entry[1]}", c.quant] = c.stats["speedup_compound"]
    shown = pd.DataFrame([{"name": c.name + (" (A/A)" if c.control else ""), "point": found[c.cell_id].point,
                           "lo": found[c.cell_id].lo, "hi": found[c.cell_id].hi, "label": found[c.cell_id].label}
                          for c in cells if c.cell_id in found and not c.numerics_only],
                         columns=["name", "point", "lo", "hi", "label"])
    return {"latency.png": lambda p: figures.plot_latency(curves, p),
            "compound_heatmap.png": lambda p: figures.plot_heatmaps(
                {"compound speedup over fp32 plain": grid}, p, numerics=set(numerics)),
            "interactions.png": lambda p: figures.plot_interactions(shown, p, MARGIN),
            "decomposition.png": lambda p: figures.plot_decomposition(pd.DataFrame(
                {name: {k: d[k] for k in ("interaction", *FACTOR_NAMES)} for name, d in table.items()},
                index=["interaction", *FACTOR_NAMES]).T, p),
            "heldout.png": lambda p: figures.plot_heldout(held, p)}


def build_report(results: str | os.PathLike, n_boot: int = N_BOOT, devices: tuple[str, ...] = (),
                 curve_files: tuple[str, ...] = ()) -> tuple[str, list[str], dict, dict]:
    """(REPORT.md text, verdict lines, JSON summary, figures {file name: plotting thunk})."""
    cells = sorted(load_cells(results, n_boot), key=cell_order)  # each with its stored statistics
    found = verdicts(cells, n_boot)
    held_out = costs.heldout_score(cells)
    accept = acceptance_table(cells)
    drifts = {c.cell_id: drift(c.rows) for c in cells}
    by_batch: dict[int, dict[str, float]] = {}  # a batch's tokens/s is all its rows': compare like with like
    for c in cells:
        by_batch.setdefault(c.labels.get("batch", 1), {})[c.cell_id] = drifts[c.cell_id]["median"]
    spread = max(job_drift(medians) for medians in by_batch.values())
    fit = costs.curve_fit(cells)
    kv_md, kv_verdict, kv_summary = kv.report_parts(results, n_boot=n_boot)  # RESULTS/kv_curve.json, the sweep
    kv_met = "met" if (kv_summary or {}).get("control") == "within" else "NOT met"  # the KV A/A control's target
    verdict = (_verdict(cells, found, accept, held_out.score, spread, len(by_batch))
               + [f"{line} (control target within: {kv_met})" for line in kv_verdict])[:15]
    curves: dict[str, list[LatencyCurve]] = {}  # per kernel, every cell's measurement of it (once per cell)
    for cell in cells:
        target, reference = cell.curves()
        for curve in (target,) if reference is target else (target, reference):
            curves.setdefault(curve.target, []).append(curve)
    md = ["# Do quantization and speculative decoding compound or fight? Findings on this machine", "",
          "## Verdict", "", *verdict, "", "## Setting and limits", "", *_setting_lines(cells), f"- {_limits(cells)}", "",
          *_rules_md(cells, found), *_decomposition_md(decomposition(cells, found)), *_speedups_md(cells, drifts),
          *batch_section(pd.concat([c.rows for c in cells]), n_boot),  # [] for a single-batch store
          "![compound](compound_heatmap.png)", "", *_acceptance_md(cells, accept), *costs.heldout_md(held_out),
          *_mechanism_md(curves), *costs.curve_fit_md(fit),
          *kv_md,  # starts with a blank line; [] without a KV curve or sweep
          *costs.projection_md(cells, list(devices), list(curve_files)), ""]
    summary = _summary(cells, found, held_out.score, spread, fit, kv_summary)
    control = mechanism_control(results, cells, found)
    if control is not None:
        summary["mechanism_control"] = control
        verdict[14:] = [f"- Mechanism control ({control['drafter']}): {text(control)}"]
        md.insert(md.index("## Setting and limits") - 1, verdict[-1])
    summary["prediction"] = predictions(results, cells, found)
    md[md.index("## Setting and limits") - 1:md.index("## Setting and limits") - 1] = [
        f"- Predicted before it ran, {p['cell']}: {text(p)}" for p in summary["prediction"]]
    return "\n".join(md), verdict, summary, _figures(cells, found, curves, held_out.held, summary["decomposition"])


def write_report(results: str | os.PathLike, n_boot: int = N_BOOT, devices: tuple[str, ...] = (),
                 curve_files: tuple[str, ...] = ()) -> Report:
    """Write RESULTS/REPORT.md and its PNGs; returns the path, the verdict lines and the JSON summary."""
    markdown, verdict, summary, figures = build_report(results, n_boot, devices, curve_files)
    root = Path(results)
    for name, draw in figures.items():
        draw(root / name)
    atomic_text(root / "REPORT.md", markdown)
    return Report(path=root / "REPORT.md", verdict=verdict, summary=summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write RESULTS/REPORT.md and PNGs; print the verdict and a JSON line.")
    parser.add_argument("results", help="a results store directory")
    parser.add_argument("--bootstrap", type=int, default=N_BOOT, help="bootstrap resamples (fixed seed)")
    parser.add_argument("--project-device", action="append", default=[], metavar="NAME=CURVE",
                        help=f"project to a known device by roofline ({', '.join(costmodel.DEVICES)}); CURVE is a "
                             "latency curve file measured on that device, which gives the per-forward overhead")
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


if __name__ == "__main__":
    sys.exit(main())
