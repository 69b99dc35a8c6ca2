"""The leaderboard: ranks drafter x shape x bits by MAL and by speedup, with bootstrap intervals.

Owns the aggregation of stored rows into boards (one per `SETTING`), their rendering (markdown, CSV, PNGs) and a cell's
one-line summary; statistics pool an entry's turns, intervals are 95% bootstraps over questions. Knows nothing about
how rows were measured.

    python -m experiments.leaderboard RESULTS [--out DIR] [--bootstrap 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments import specbench
from experiments.heldout import pooled
from experiments.store import StoreError, load_rows, open_existing

SETTING = ["model", "dataset", "prompts", "temperature", "top_k", "top_p", "seed", "max_new_tokens"]
"""What makes a board: entries are only ranked against entries run on the same prompts (`prompts` is
the content hash of the selected questions), model, sampling and length."""
ENTRY = ["drafter", "shape", "quant", "bits"]
CELL_SEED = 0  # Bootstrap seed of a cell's statistics (`stored_stats`), drawn once and stored with the cell.
N_BOOT = 2000  # Bootstrap resamples of a cell's stored intervals: the console line, REPORT.md and the board read them.
STATS_FILE = "stats.json"
_SUMS = ["steps", "accepted_tokens", "new_tokens", "wall_time_s", "baseline_new_tokens", "baseline_wall_time_s",
         "reference_new_tokens", "reference_wall_time_s"]
SPEEDUPS = ("speedup", "speedup_quant", "speedup_compound")
"""Speculation alone, quantization alone, compound (see the module docstring)."""


class LeaderboardError(ValueError):
    """Rows that cannot be ranked (e.g. written by a runner without the reference run)."""


def board_name(setting: dict) -> str:
    regime = "T=0" if setting["temperature"] == 0 else f"T={setting['temperature']:g}"
    sampling = "" if setting["temperature"] == 0 else f" top_k={setting['top_k']} top_p={setting['top_p']:g}"
    prompts = f"dataset {setting['dataset']} (prompts {setting['prompts'][:6]})"
    length = f"{setting['max_new_tokens']} new tokens"
    return f"{regime}{sampling} seed={setting['seed']} | {setting['model']} | {prompts} | {length}"


def board_slug(setting: dict) -> str:
    regime = "T0" if setting["temperature"] == 0 else f"T{setting['temperature']:g}"
    parts = [f"{regime}s{setting['seed']}", setting["model"], f"{setting['dataset']}-{setting['prompts'][:6]}",
             setting["max_new_tokens"]]
    return "_".join(map(str, parts)).replace("/", "-")


def _stats(sums: np.ndarray) -> dict[str, np.ndarray]:
    """MAL and the three speedups from summed columns `_SUMS` (last axis)."""
    steps, accepted, new, wall, base_new, base_wall, ref_new, ref_wall = np.moveaxis(sums, -1, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        drafted, plain, reference = new / wall, base_new / base_wall, ref_new / ref_wall
        return {"mal": 1.0 + accepted / steps, "speedup": drafted / plain, "speedup_quant": plain / reference,
                "speedup_compound": drafted / reference}


def question_sums(rows: pd.DataFrame) -> pd.DataFrame:
    """`_SUMS` summed per question (a question's turns stay together when resampled). Rows of an older
    runner have no reference run: their quantization and compound speedups are NaN."""
    missing = [c for c in _SUMS if c not in rows.columns]
    if set(missing) - {"reference_new_tokens", "reference_wall_time_s"}:
        raise LeaderboardError(f"rows lack {missing}: they were not written by the experiments runner")
    return rows.assign(**{c: np.nan for c in missing}).groupby("question_id")[_SUMS].sum(min_count=1)


def entry_stats(rows: pd.DataFrame, n_boot: int, rng: np.random.Generator) -> dict:
    """Pooled statistics of one entry's rows, with bootstrap intervals over questions."""
    sums = question_sums(rows)
    per_question = sums.to_numpy(dtype=float)  # [Q, 8]
    point = _stats(per_question.sum(0))
    out = {"questions": len(per_question), "turns": len(rows), "mal": float(point["mal"]),
           "mean_accepted_tokens": float(point["mal"]) - 1.0, **{k: float(point[k]) for k in SPEEDUPS}}
    if n_boot > 0:
        idx = rng.integers(0, len(per_question), size=(n_boot, len(per_question)))  # [B, Q]
        boot = _stats(per_question[idx].sum(1))  # each [B]
        for name in ("mal", *SPEEDUPS):
            finite = boot[name][~np.isnan(boot[name])]
            out[f"{name}_lo"] = np.percentile(finite, 2.5) if finite.size else np.nan
            out[f"{name}_hi"] = np.percentile(finite, 97.5) if finite.size else np.nan
    totals = sums.sum()
    out["tokens_per_s"] = totals["new_tokens"] / totals["wall_time_s"]
    out["baseline_tokens_per_s"] = totals["baseline_new_tokens"] / totals["baseline_wall_time_s"]
    out["same_tokens_as_baseline"] = float(rows["same_tokens_as_baseline"].mean())
    return out


def stored_stats(store, cell_id: str, rows: pd.DataFrame, n_boot: int = N_BOOT) -> dict:
    """A cell's `entry_stats`, bootstrapped once (seed `CELL_SEED`) and kept in its `stats.json`, so the console,
    REPORT.md and the leaderboard print the same intervals; another `n_boot` draws its own and stores nothing."""
    path = store.cell_dir(cell_id) / STATS_FILE
    if path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("n_boot") == n_boot:
            return stored["stats"]
    stats = {k: v.item() if isinstance(v, np.generic) else v
             for k, v in entry_stats(rows, n_boot, np.random.default_rng(CELL_SEED)).items()}
    if n_boot == N_BOOT:
        try:
            atomic_text(path, json.dumps({"n_boot": n_boot, "seed": CELL_SEED, "stats": stats}) + "\n")
        except PermissionError:  # a read-only store: the seeded draw gives these same numbers next time
            pass
    return stats


def acceptance_curve(rows: pd.DataFrame) -> list[float]:
    """Pooled acceptance rate per draft depth (index d-1) over `rows`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return list(np.array(pooled(rows["accepted_by_depth"]), float) / np.array(pooled(rows["reached_by_depth"])))


def position_rates(rows: pd.DataFrame) -> tuple[list[float], list[float]]:
    """(acceptance rate at draft position i given 1 .. i-1 accepted, share of steps accepting k draft tokens), pooled
    over `rows` from their `specdec.core.metrics.position_acceptance` counts; ([], []) for rows stored without them."""
    if "position_tried" not in rows:
        return [], []
    tried, kept, histogram = (np.array(pooled(rows[c]), dtype=float)
                              for c in ("position_tried", "position_kept", "accept_histogram"))
    with np.errstate(divide="ignore", invalid="ignore"):
        return [float(r) for r in kept / tried], [float(h) for h in histogram / max(histogram.sum(), 1)]


def build_table(rows: pd.DataFrame, n_boot: int = N_BOOT, seed: int = 0, cells: dict | None = None) -> pd.DataFrame:
    """One line per (setting, category incl. `overall`, entry), ranked by MAL and by speedup within each (setting,
    category); a one-cell entry's overall line comes from `cells` ({cell id: `stored_stats`}) when given."""
    rng = np.random.default_rng(seed)
    records = []
    for keys, group in rows.groupby(SETTING + ENTRY, sort=True, dropna=False):
        labels = dict(zip(SETTING + ENTRY, keys))
        ids = set(group["cell_id"]) if "cell_id" in group else set()
        for category, part in [("overall", group), *group.groupby("category", sort=True)]:
            numerics_only = bool(part["numerics_only"].any()) if "numerics_only" in part else False
            one = category == "overall" and len(ids) == 1 and (cells or {}).get(next(iter(ids)))
            rates, histogram = position_rates(part)
            records.append({**labels, "board": board_name(labels), "category": category,
                            "numerics_only": numerics_only, **(one or entry_stats(part, n_boot, rng)),
                            "position_acceptance": rates, "accept_histogram": histogram})
    table = pd.DataFrame(records)
    within = table.groupby(["board", "category"])
    table["rank_mal"] = within["mal"].rank(ascending=False, method="min").astype(int)
    table["rank_speedup"] = within["speedup"].rank(ascending=False, method="min").astype(int)
    # End-to-end speed over fp32 plain ranks real kernels only: a numerics-only row runs at fp32 cost.
    real = table[~table.numerics_only.astype(bool)]
    table["rank_compound"] = real.groupby(["board", "category"])["speedup_compound"].rank(
        ascending=False, method="min").reindex(table.index).fillna(0).astype(int)
    return table


def _ci(row: pd.Series, name: str, fmt: str) -> str:
    if f"{name}_lo" not in row:
        return format(row[name], fmt)
    return f"{row[name]:{fmt}} [{row[f'{name}_lo']:{fmt}}, {row[f'{name}_hi']:{fmt}}]"


def _quant_label(row: pd.Series) -> str:
    return f"{row.quant} (numerics only)" if row.get("numerics_only") is True else str(row.quant)


def to_markdown(table: pd.DataFrame) -> str:
    lines = ["# specdec leaderboard", "",
             "MAL = mean acceptance length (tokens per target forward, bonus included). Speedups are tokens/s "
             "ratios of runs measured side by side: *speculation* = drafted / plain loop on the same target, "
             "*quantization* = plain loop on the target / plain loop on the unquantized reference, *compound* = "
             "drafted / reference plain loop. [95% bootstrap CI over questions]. *Numerics only*: weights "
             "stored dequantized, so the bit-width changes acceptance, never cost.", ""]
    for board, part in table.groupby("board", sort=False):
        overall = part[part.category == "overall"]
        lines += [f"## {board}", ""]
        numerics = overall.numerics_only.astype(bool)
        for title, key, part_rows in (
                ("by end-to-end speed over fp32 plain (compound)", "rank_compound", overall[~numerics]),
                ("by MAL", "rank_mal", overall[~numerics]),
                ("numerics only (weights stored dequantized: fp32 cost, so only MAL says something), by MAL",
                 "rank_mal", overall[numerics])):
            if part_rows.empty:
                continue
            lines += [f"### Ranked {title}", "",
                      "| rank | drafter | shape | quant | bits | questions | MAL | speculation | quantization | "
                      "compound | tok/s | plain tok/s |",
                      "|---:|---|---|---|---:|---:|---|---|---|---|---:|---:|"]
            for _, r in part_rows.sort_values([key, "drafter", "shape", "bits"]).iterrows():
                lines.append(f"| {r[key]} | {r.drafter} | `{r['shape']}` | {_quant_label(r)} | {r.bits:g} | "
                             f"{r.questions} | {_ci(r, 'mal', '.2f')} | {_ci(r, 'speedup', '.2f')}x | "
                             f"{_ci(r, 'speedup_quant', '.2f')}x | {_ci(r, 'speedup_compound', '.2f')}x | "
                             f"{r.tokens_per_s:.1f} | {r.baseline_tokens_per_s:.1f} |")
            lines.append("")
        lines += ["### Acceptance per draft position and accepted tokens per step", "",
                  "Rate at draft position i given positions 1 .. i-1 accepted; share of steps that accepted k "
                  "draft tokens (per request: the rows' `accept_histogram`).", "",
                  "| drafter | shape | quant | rate at position 1, 2, ... | steps accepting 0, 1, 2, ... |",
                  "|---|---|---|---|---|"]
        for _, r in overall.sort_values(["drafter", "shape", "quant"]).iterrows():
            lines.append(f"| {r.drafter} | `{r['shape']}` | {_quant_label(r)} | "
                         + " / ".join(f"{v:.2f}" if np.isfinite(v) else "-" for v in r.position_acceptance) + " | "
                         + " / ".join(f"{v:.0%}" for v in r.accept_histogram) + " |")
        lines.append("")
        categories = sorted(set(part.category) - {"overall"})
        lines += ["### Per category: MAL / speculation speedup", "",
                  "| drafter | shape | quant | " + " | ".join(categories) + " |",
                  "|---|---|---|" + "---|" * len(categories)]
        for (drafter, shape, quant), entry in part.groupby(["drafter", "shape", "quant"], sort=True):
            cells = {r.category: f"{r.mal:.2f} / {r.speedup:.2f}x" for _, r in entry.iterrows()}
            values = " | ".join(cells.get(c, "") for c in categories)
            lines.append(f"| {drafter} | `{shape}` | {quant} | {values} |")
        lines.append("")
    return "\n".join(lines)


def plot_board(overall: pd.DataFrame, rows: pd.DataFrame, title: str, out: Path, slug: str) -> None:
    """A board's figures: heatmap_SLUG.png (MAL and speculation, drafter x shape by kernel, sized to the
    cells present) and acceptance_SLUG.png (the rate per draft position, `position_rates`, per drafter)."""
    from experiments import figures

    order = overall.assign(_n=overall.numerics_only.astype(bool)).sort_values(["_n", "bits"], ascending=[True, False])
    kernels = list(dict.fromkeys(order.quant))
    numerics = set(order.quant[order._n])
    entries = overall.assign(entry=overall.drafter + " " + overall["shape"])
    panels = {label: entries.pivot_table(index="entry", columns="quant", values=metric, aggfunc="first")
              .reindex(columns=kernels) for label, metric in (("MAL", "mal"), ("speculation speedup", "speedup"))}
    figures.plot_heatmaps(panels, out / f"heatmap_{slug}.png", title, numerics)
    curves = {}
    for (drafter, shape, quant), entry in rows.groupby(["drafter", "shape", "quant"], sort=True):
        rates = position_rates(entry)[0] or acceptance_curve(entry)  # rows stored before the per-position counts
        curves.setdefault(drafter, []).append((f"{shape} {quant}", rates, quant in numerics))
    figures.plot_acceptance(curves, title, out / f"acceptance_{slug}.png")


def atomic_text(path: Path, text: str) -> None:
    """Write `text` to `path` in one step (a temporary file, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_leaderboard(results: str | os.PathLike, out: str | os.PathLike | None = None, n_boot: int = N_BOOT,
                      seed: int = 0) -> tuple[str, Path]:
    """Write leaderboard.md, leaderboard.csv, the PNGs and Spec-Bench's answer files (spec_bench/) for the store at
    `results` into `out` (default RESULTS/leaderboard). Returns (markdown, out directory)."""
    rows = load_rows(results)
    store = open_existing(results)
    cells = {cid: stored_stats(store, cid, part.reset_index(drop=True), n_boot)
             for cid, part in rows.groupby("cell_id", sort=True)} if "cell_id" in rows else {}
    table = build_table(rows, n_boot=n_boot, seed=seed, cells=cells)
    out_dir = Path(out) if out is not None else Path(results) / "leaderboard"
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = to_markdown(table)
    atomic_text(out_dir / "leaderboard.md", markdown + "\n")
    atomic_text(out_dir / "leaderboard.csv", table.to_csv(index=False))
    if {"text", "accept_lengths"} <= set(rows.columns):  # rows of an older runner lack what Spec-Bench reads
        specbench.write_answers(rows, out_dir / "spec_bench")
    for keys, part in rows.groupby(SETTING, sort=True, dropna=False):
        setting = dict(zip(SETTING, keys))
        name, slug = board_name(setting), board_slug(setting)
        plot_board(table[(table.board == name) & (table.category == "overall")], part, name, out_dir, slug)
    return markdown, out_dir


def format_speedups(stats: dict) -> str:
    """`speculation 1.31x [1.12, 1.50] | quantization 1.6x [..] | compound 2.1x [..]` from `entry_stats`."""
    names = {"speedup": "speculation", "speedup_quant": "quantization", "speedup_compound": "compound"}
    return " | ".join(f"{label} {stats[key]:.2f}x [{stats[key + '_lo']:.2f}, {stats[key + '_hi']:.2f}]"
                      for key, label in names.items())


def cell_summary(store, cell_id: str, n_boot: int = N_BOOT) -> str:
    """One line with a stored cell's MAL and three speedups, each with its 95% bootstrap CI (`stored_stats`)."""
    rows = pd.read_json(store.cell_dir(cell_id) / "rows.jsonl", lines=True, dtype=False)
    stats = stored_stats(store, cell_id, rows, n_boot)
    first = rows.iloc[0]
    return (f"cell {cell_id}: {first.drafter} {first['shape']} on {first.quant} | {stats['questions']} questions, "
            f"{int(rows.new_tokens.sum())} tokens | MAL {_ci(pd.Series(stats), 'mal', '.2f')} | "
            f"{format_speedups(stats)} (95% bootstrap CI over questions)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a results store directory (results.dir of the runs)")
    parser.add_argument("--out", help="output directory (default RESULTS/leaderboard)")
    parser.add_argument("--bootstrap", type=int, default=N_BOOT, help="bootstrap resamples (0 = no intervals)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    args = parser.parse_args(argv)
    try:
        markdown, out_dir = write_leaderboard(args.results, args.out, n_boot=args.bootstrap, seed=args.seed)
    except (StoreError, LeaderboardError, OSError) as err:
        print(f"leaderboard: error: {err}", file=sys.stderr)
        return 2
    print(markdown)
    print(f"wrote {out_dir}/leaderboard.md, leaderboard.csv, heatmap_*.png, acceptance_*.png, spec_bench/",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
