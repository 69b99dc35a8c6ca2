"""The findings report: does quantization compound with speculative decoding, or fight it, here?

    python -m experiments.report RESULTS [--project-device H200=h200_curve.json] [--project-curve FILE ...]

Owns the reading of a results store into cells (rows + the latency curves each cell stored), the
verdict lines (rules in `experiments.verdict`: the paired interaction per drafter x shape x kernel,
an A/A control that must read compound), the out-of-sample cost-model score and projections (`experiments.costs`),
acceptance apart from cost (text identity with fp32, teacher-forced beside free-running acceptance),
and REPORT.md with its PNGs (`experiments.figures`).
Everything comes from the store: the same store gives the same REPORT.md, byte for byte (fixed
bootstrap seed, sorted cells, no timestamps). Knows nothing about how cells were measured beyond the
row and metadata fields the runner writes. "Numerics only" rows (weights stored dequantized: rtn,
gptqref) say only how acceptance changes: they get no speed verdict and sit apart in every table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from experiments import costs, figures, heldout, kv
from experiments.costs import md_table
from experiments.batches import batch_section
from experiments.leaderboard import SETTING, LeaderboardError, entry_stats
from experiments.store import StoreError, load_rows, open_existing
from experiments.verdict import MARGIN, Interaction, drift, interaction, is_paired, job_drift
from specdec.measure import costmodel
from specdec.core.curve import LatencyCurve

SEED = 0
REFERENCE = "none"
LIMITS = ("Limits: a 135M model (SmolLM2-135M), on CPU (one torch thread, shared cores), weights from a Q4_1 "
          "GGUF (so 4-bit g32 kernels are near-lossless), and quantized targets write different text (so "
          "free-running acceptance mixes 'bits change acceptance' with 'bits change the text').")




class ReportError(ValueError):
    """A store the report cannot use (cells without latency curves, two cells for one entry, ...)."""


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
        """(drafter, shape), the shape marked with its batch size in a batch cell (`chain(4) @b8`)."""
        batch = self.labels.get("batch", 1)
        return self.labels["drafter"], self.labels["shape"] + (f" @b{batch}" if batch > 1 else "")

    @property
    def quant(self) -> str:
        return self.labels["quant"]

    @property
    def numerics_only(self) -> bool:
        return bool(self.labels.get("numerics_only"))

    @property
    def control(self) -> bool:
        return bool(self.labels.get("control"))

    @property
    def name(self) -> str:
        return f"{self.entry[0]} {self.entry[1]} on {self.quant}"

    def curves(self) -> tuple[LatencyCurve, LatencyCurve]:
        """(target, reference) latency curves stored with the cell."""
        latency = self.meta["latency"]
        target = LatencyCurve.from_json(latency["target"], f"cell {self.cell_id} target curve")
        reference = latency.get("reference")
        return target, (LatencyCurve.from_json(reference, f"cell {self.cell_id} reference curve")
                        if reference is not None else target)

    def row_curves(self) -> tuple[dict[int, LatencyCurve], dict[int, LatencyCurve]]:
        """(target, reference) curves by rows per forward, 1 .. the cell's batch ({} for a cell stored
        without the fewer rows' curves, and for a batch-1 cell: its one curve is `curves()`)."""
        latency, out = self.meta["latency"], []
        for role, curve in zip(("target", "reference"), self.curves()):
            own = role if role in latency else "target"  # the fp32 cell is its own reference
            rows = latency.get(f"{own}_rows") or {}
            out.append({int(r): LatencyCurve.from_json(c, f"cell {self.cell_id} {own} curve at {r} rows")
                        for r, c in rows.items()} | ({curve.batch: curve} if rows else {}))
        return out[0], out[1]

    def parts(self) -> tuple[costmodel.RunParts, costmodel.RunParts, costmodel.RunParts]:
        """(drafted, plain, reference) measured parts, summed over the cell's rows (for projections; a
        batch cell's per batch step, `heldout.steps`)."""
        r = self.rows
        context = heldout.row_context(r, "new_tokens")

        def run(prefix: str) -> costmodel.RunParts:
            forwards, verify_s = heldout.steps(r, prefix)
            return costmodel.RunParts(
                new_tokens=int(r[f"{prefix}new_tokens"].sum()), forwards=forwards, context=context,
                prefill_s=float(r[f"{prefix}prefill_time_s"].sum()),
                other_s=float((r[f"{prefix}wall_time_s"] - r[f"{prefix}prefill_time_s"]).sum()) - verify_s)

        return run(""), run("baseline_"), run("reference_")


@dataclass
class Report:
    path: Path
    verdict: list[str]
    """At most 15 lines."""
    summary: dict
    """The JSON line: cells, control, verdict, cost_model, drift, curves (`costs.curve_fit_summary`), kv."""


def load_cells(results: str | os.PathLike) -> list[Cell]:
    """Every finished cell of the store with its rows and metadata; ReportError naming the cells that
    lack what the report needs, or two cells measuring one drafter x shape x kernel."""
    rows = load_rows(results)
    store = open_existing(results)
    cells, old = [], []
    for cid, part in rows.groupby("cell_id", sort=True):
        meta = store.read_meta(cid)
        if "latency" not in meta or "verify_widths" not in part or "reference_wall_time_s" not in part:
            old.append(cid)
        else:
            cells.append(Cell(cid, {}, part.reset_index(drop=True), meta))
    if old:
        names = ", ".join(old[:6]) + (", ..." if len(old) > 6 else "")
        raise ReportError(
            f"{len(old)} cell(s) of {results} lack the latency curves or the reference run the report needs "
            f"({names}): they were written by an older runner. Rerun them with this one into a new results.dir "
            "(python -m experiments.run -m ... results.dir=NEW, or python -m experiments.main results.dir=NEW); "
            "each cell then stores its target's latency curve (runner.latency_widths / latency_contexts)")
    settings = {tuple(str(part[k].iloc[0]) for k in SETTING) for _, part in rows.groupby("cell_id")}
    if len(settings) > 1:
        raise ReportError(f"{results} holds {len(settings)} settings ({', '.join(SETTING)} differ between cells); the "
                          "report compares cells of one setting: give each setting its own results.dir")
    seen: dict[tuple, str] = {}
    for cell in cells:
        first = cell.rows.iloc[0]
        cell.labels = {**first[["drafter", "shape", "quant", "bits", "model", "dataset", "prompts", "temperature",
                                "max_new_tokens"]].to_dict(),
                       "numerics_only": bool(first.get("numerics_only", False)),
                       "control": isinstance(first.get("control"), (bool, np.bool_)) and bool(first.get("control")),
                       "batch": int(first["batch"]) if pd.notna(first.get("batch", np.nan)) else 1}
        key = (cell.entry, cell.quant)
        if key in seen:
            raise ReportError(f"{results} holds two cells for {cell.name} ({seen[key]}, {cell.cell_id}): one was "
                              "measured under an older protocol (the cell key's `protocol`, experiments.run.PROTOCOL: "
                              "unpaired runs, or shared curves). Run the grid into a new results.dir")
        seen[key] = cell.cell_id
    return cells


# ---- verdicts, acceptance ---------------------------------------------------------------------------


def _ci(stats: dict, key: str) -> str:
    return f"{stats[key]:.2f}x [{stats[key + '_lo']:.2f}, {stats[key + '_hi']:.2f}]"


def verdicts(cells: list[Cell], n_boot: int) -> dict[str, Interaction]:
    """{cell id: its interaction and verdict} for every cell on a kernel other than fp32 itself."""
    rng = np.random.default_rng(SEED)
    return {c.cell_id: interaction(c.rows, n_boot, rng) for c in cells if c.quant != REFERENCE}


def acceptance_table(cells: list[Cell]) -> pd.DataFrame:
    """Per cell: free-running MAL on the kernel and on fp32 (same prompts), teacher-forced MAL on the
    fp32 text, and the share of prompts whose plain text equals fp32's."""
    records = []
    for c in cells:
        r = c.rows
        same = r.groupby("question_id").same_tokens_as_reference.all() if "same_tokens_as_reference" in r else None
        tf = (float(r.new_tokens.sum() / (r.new_tokens / r.tf_mal).sum())  # pooled: tokens / implied steps
              if "tf_mal" in r and r.tf_mal.notna().all() else np.nan)
        fp32 = (1 + r.reference_drafted_accepted_tokens.sum() / r.reference_drafted_steps.sum()
                if is_paired(r) else (c.stats["mal"] if c.quant == REFERENCE else np.nan))
        records.append({"name": c.name, "quant": c.quant, "numerics_only": c.numerics_only, "mal": c.stats["mal"],
                        "fp32_mal": fp32, "tf_mal": tf,
                        "same_text": float(same.mean()) if same is not None else np.nan})
    return pd.DataFrame(records)


# ---- the report ------------------------------------------------------------------------------------


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


def _order(c: Cell) -> tuple:
    return (c.numerics_only, c.entry, not c.control, c.quant != REFERENCE, c.quant)


def build_report(results: str | os.PathLike, n_boot: int = 2000, devices: tuple[str, ...] = (),
                 curve_files: tuple[str, ...] = ()) -> tuple[str, list[str], dict, dict]:
    """(REPORT.md text, verdict lines, JSON summary, figures {file name: plotting thunk})."""
    cells = sorted(load_cells(results), key=_order)
    rng = np.random.default_rng(SEED)
    for cell in cells:
        cell.stats = entry_stats(cell.rows, n_boot, rng)
    found = verdicts(cells, n_boot)
    held_out = costs.heldout_score(cells)
    score = held_out.score
    accept = acceptance_table(cells)
    drifts = {c.cell_id: drift(c.rows) for c in cells}
    by_batch: dict[int, dict[str, float]] = {}  # a batch's tokens/s is all its rows': compare like with like
    for c in cells:
        by_batch.setdefault(c.labels.get("batch", 1), {})[c.cell_id] = drifts[c.cell_id]["median"]
    spread = max(job_drift(medians) for medians in by_batch.values())
    controls = [found[c.cell_id] for c in cells if c.control and c.cell_id in found]
    speed = [c for c in cells if c.cell_id in found and not c.numerics_only and not c.control]

    verdict = [f"Do quantization and speculative decoding compound here? ({len(cells)} cells, "
               f"{cells[0].labels['model']}, dataset {cells[0].labels['dataset']}, {int(cells[0].stats['questions'])} "
               f"prompts x {cells[0].labels['max_new_tokens']} tokens, CPU)", f"- {LIMITS}"]
    control = next((v.label for v in controls if v.label != "compound"), "compound") if controls else None
    for c in (c for c in cells if c.control and c.cell_id in found):
        verdict.append(f"- A/A control ({c.name}, fp32 measured again): {found[c.cell_id].text()}"
                       + ("" if found[c.cell_id].label == "compound" else " -- NOT compound: distrust the verdicts below"))
    if not controls:
        verdict.append("- A/A control: none in this store (quant=fp32_again), so the rules below are unchecked")
    for c in speed:
        v = found[c.cell_id]
        verdict.append(f"- {c.name}: {v.text()}; compound {_ci(c.stats, 'speedup_compound')}")
    unpaired = [c.name for c in cells if c.cell_id in found and found[c.cell_id].label == "unpaired"]
    if unpaired:
        verdict.append(f"- Downgraded: {len(unpaired)} cell(s) have no paired fp32 drafted runs (older store): no verdict")
    real = [c for c in cells if not c.numerics_only]
    best = max(real, key=lambda c: c.stats["speedup_compound"]) if real else None
    if best is not None and best.stats["speedup_compound_lo"] > 1.0:
        verdict.append(f"- Fastest over fp32 plain: {best.name}, {_ci(best.stats, 'speedup_compound')}.")
    else:
        verdict.append("- No entry is reliably faster than fp32 plain decoding (every compound CI includes or lies below 1.0).")
    kernels = accept[~accept.numerics_only & (accept.quant != REFERENCE)]
    if len(kernels):
        verdict.append("- Same plain text as fp32: " + "; ".join(
            f"{q} {s:.0%}" for q, s in kernels.groupby("quant").same_text.mean().items() if np.isfinite(s))
            + " of prompts (numerics-only in REPORT.md)")
    verdict += costs.verdict_line(score)
    verdict.append(f"- Drift: fp32 plain tok/s per cell (median) spans {spread:.0%} of its median across the job"
                   + (" (the most within one batch size)" if len(by_batch) > 1 else ""))
    fit = costs.curve_fit(cells)
    curves_fit = costs.curve_fit_summary(fit)  # {} without a batch-1 cell
    kv_md, kv_verdict, kv_summary = kv.report_parts(results, n_boot=n_boot)  # RESULTS/kv_curve.json, the sweep
    verdict = (verdict + kv_verdict)[:15]

    summary = {"cells": len(cells), "control": control,
               "verdict": {c.name: found[c.cell_id].label for c in speed},
               "interaction": {c.name: [round(found[c.cell_id].point, 4), round(found[c.cell_id].lo, 4),
                                        round(found[c.cell_id].hi, 4)] for c in speed + [c for c in cells if c.control]},
               "cost_model": score, "drift": round(spread, 4),
               **({"curves": curves_fit} if curves_fit else {}), **({"kv": kv_summary} if kv_summary else {})}

    curves: dict[str, LatencyCurve] = {}
    for cell in cells:
        for curve in cell.curves():
            curves.setdefault(curve.target, curve)
    md = ["# Do quantization and speculative decoding compound or fight? Findings on this machine", "",
          "## Verdict", "", *verdict, "", "## Setting and limits", "", *_setting_lines(cells), f"- {LIMITS}", "",
          "## Rules", "",
          f"Per prompt, the interaction = (speculation speedup on the kernel) / (on fp32), from four runs back to "
          f"back in rotating order (fp32 plain, fp32 drafted, kernel plain, kernel drafted); geometric mean over "
          f"prompts, 95% bootstrap CI over prompts. **fight**: CI wholly below 1; **compound**: CI lower end >= "
          f"{MARGIN} and not a fight; otherwise **inconclusive**, with the prompts the CI's width says would settle "
          "it. The A/A control (fp32 measured again under another label) has a true interaction of 1 and must read "
          "compound. Numerics-only kernels run at fp32 cost: no speed verdict.", "", "![interactions](interactions.png)", ""]
    lines = []
    for c in cells:
        if c.cell_id not in found:
            continue
        v = found[c.cell_id]
        kind = " (A/A control)" if c.control else " (numerics only)" if c.numerics_only else ""
        ci = "" if v.label == "unpaired" else f"{v.point:.2f} [{v.lo:.2f}, {v.hi:.2f}]"
        lines.append([f"{c.entry[0]}", f"`{c.entry[1]}`", c.quant + kind, f"**{v.label}**", ci, str(v.questions),
                      str(v.settle or ""), _ci(c.stats, "speedup"), _ci(c.stats, "speedup_compound")])
    md += md_table(["drafter", "shape", "kernel", "verdict", "interaction", "prompts", "prompts to settle",
                     "speculation on kernel", "compound"], lines)
    md += ["", "## Three speedups per cell, and drift", "",
           "Speculation = drafted / plain on the same kernel; quantization = plain on the kernel / fp32 plain; compound "
           "= drafted on the kernel / fp32 plain (pooled tokens/s, 95% bootstrap CI over prompts). fp32 plain tok/s: "
           "median [min, max] over the cell's prompts (the drift of the baseline within and across cells). Same "
           "tokens = the share of turns whose drafted output equals the plain loop's on the same kernel (a kernel "
           "whose rounding depends on the forward's width can flip near-ties).", ""]
    for title, group in (("Real kernels", [c for c in cells if not c.numerics_only]),
                         ("Numerics only (fp32 cost: speed columns are fp32's)", [c for c in cells if c.numerics_only])):
        if not group:
            continue
        md += [f"### {title}", ""]
        md += md_table(["drafter", "shape", "kernel", "MAL", "speculation", "quantization", "compound",
                         "fp32 plain tok/s", "same tokens"],
                        [[c.entry[0], f"`{c.entry[1]}`", c.quant, f"{c.stats['mal']:.2f} [{c.stats['mal_lo']:.2f}, "
                          f"{c.stats['mal_hi']:.2f}]", _ci(c.stats, "speedup"), _ci(c.stats, "speedup_quant"),
                          _ci(c.stats, "speedup_compound"), "{median:.1f} [{min:.1f}, {max:.1f}]".format(**drifts[c.cell_id]),
                          f"{c.stats['same_tokens_as_baseline']:.0%}"] for c in group])
        md.append("")
    md += batch_section(pd.concat([c.rows for c in cells]), n_boot)  # [] for a single-batch store
    md += ["![compound](compound_heatmap.png)", "", "## Acceptance apart from cost", "",
           "Free-running MAL on the kernel and on fp32 (same prompts, paired runs); teacher-forced MAL: the drafter's "
           "drafts along the fp32 plain continuation judged by the kernel's argmax after each prefix of that same "
           "text, so every kernel is scored on one text; same text: the share of prompts whose plain output on the "
           "kernel equals fp32's. A gap between free-running and teacher-forced acceptance is the text confound.", ""]
    md += md_table(["cell", "MAL (kernel)", "MAL (fp32, same prompts)", "teacher-forced MAL", "same text as fp32"],
                    [[r["name"] + (" (numerics only)" if r["numerics_only"] else ""), f"{r['mal']:.2f}",
                      f"{r['fp32_mal']:.2f}", f"{r['tf_mal']:.2f}", f"{r['same_text']:.0%}"]
                     for _, r in accept.sort_values(["numerics_only", "name"]).iterrows()])
    md += costs.heldout_md(held_out)
    md += ["", "## The mechanism: what a wide forward costs on each kernel", "",
           "Latency curves stored with the cells (median of repeats): ms of a one-token forward at the smallest "
           "context, and a forward of w tokens in one-token forwards.", "", "![latency](latency.png)", ""]
    md += md_table(["kernel", "machine", "1 token (ms)", *(f"w={w}" for w in (2, 4, 8, 16, 32))],
                    [[label, curve.machine, f"{1e3 * curve.at(1):.1f}",
                      *(f"{curve.ratio(w):.2f}x" for w in (2, 4, 8, 16, 32))] for label, curve in sorted(curves.items())])
    md += costs.curve_fit_md(fit)
    md += kv_md  # starts with a blank line; [] without a KV curve or sweep
    md += costs.projection_md(cells, list(devices), list(curve_files))
    md.append("")

    real_quants = [q for q in dict.fromkeys(c.quant for c in cells if not c.numerics_only)]
    numerics = [q for q in dict.fromkeys(c.quant for c in cells if c.numerics_only)]
    grid = pd.DataFrame(np.nan, index=sorted({f"{d} {s}" for d, s in (c.entry for c in cells)}),
                        columns=real_quants + numerics)
    for c in cells:
        grid.loc[f"{c.entry[0]} {c.entry[1]}", c.quant] = c.stats["speedup_compound"]
    shown = pd.DataFrame([{"name": c.name + (" (A/A)" if c.control else ""), "point": found[c.cell_id].point,
                           "lo": found[c.cell_id].lo, "hi": found[c.cell_id].hi, "label": found[c.cell_id].label}
                          for c in cells if c.cell_id in found and not c.numerics_only],
                         columns=["name", "point", "lo", "hi", "label"])
    figs = {"latency.png": lambda p: figures.plot_latency(curves, p),
            "compound_heatmap.png": lambda p: figures.plot_heatmap(grid, set(numerics), p),
            "interactions.png": lambda p: figures.plot_interactions(shown, p, MARGIN),
            "heldout.png": lambda p: figures.plot_heldout(held_out.held, p)}
    return "\n".join(md), verdict, summary, figs


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
    parser = argparse.ArgumentParser(description="Write RESULTS/REPORT.md and PNGs; print the verdict and a JSON line.")
    parser.add_argument("results", help="a results store directory")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (fixed seed)")
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
