"""The leaderboard on a synthetic results store: pooled statistics, bootstrap intervals, separate
T = 0 / T > 0 boards, per-category ranks, and the files it writes (markdown, CSV, PNGs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.leaderboard import acceptance_curve, build_table, write_leaderboard
from experiments.store import ResultsStore, StoreError, load_rows

REPO = Path(__file__).resolve().parent.parent


def make_row(question: str, category: str, steps: int, accepted: int, wall: float, base_wall: float,
             tokens: int = 32) -> dict:
    return {
        "question_id": question, "category": category, "turn": 1, "steps": steps, "accepted_tokens": accepted,
        "mal": 1 + accepted / steps, "mean_accepted_tokens": accepted / steps, "new_tokens": tokens,
        "wall_time_s": wall, "baseline_new_tokens": tokens, "baseline_wall_time_s": base_wall,
        "tokens_per_s": tokens / wall, "baseline_tokens_per_s": tokens / base_wall,
        "reference_new_tokens": tokens, "reference_wall_time_s": 2 * base_wall,
        "speedup": base_wall / wall, "same_tokens_as_baseline": True,
        "reached_by_depth": [steps, steps // 2], "accepted_by_depth": [accepted // 2, accepted // 4],
    }


def labels(drafter: str, shape: str, quant: str, bits: float, temperature: float) -> dict:
    return {"cell_id": f"{drafter}-{shape}-{quant}-{temperature}", "model": "m", "drafter": drafter,
            "shape": shape, "quant": quant, "bits": bits, "numerics_only": quant.startswith("rtn"),
            "dataset": "suite", "prompts": "abcdef0123",
            "temperature": temperature, "seed": 0,
            "top_k": 0, "top_p": 1.0, "max_new_tokens": 32}


@pytest.fixture
def store(tmp_path) -> Path:
    """Two drafters x two shapes x two quants at T = 0 and T = 0.7. Drafter `good` accepts more
    than `poor` everywhere; questions q0..q3 (two categories) have different acceptance."""
    results = tmp_path / "results"
    s = ResultsStore(results)
    for temperature in (0.0, 0.7):
        for drafter, skill in (("good", 3), ("poor", 1)):
            for shape in ("chain(4)", "tree(4,2,2)"):
                for quant, bits in (("none", 32.0), ("rtn4_g64", 4.0)):
                    lab = labels(drafter, shape, quant, bits, temperature)
                    rows = [{**lab, **make_row(f"q{i}", "code" if i < 2 else "chat", steps=10, accepted=skill * (i + 1),
                                               wall=1.0 + 0.1 * i, base_wall=1.2 + 0.3 * skill)}
                            for i in range(4)]
                    s.write_cell(lab["cell_id"], {"labels": lab}, rows)
    return results


def test_pooled_statistics_and_intervals(store):
    table = build_table(load_rows(store), n_boot=500, seed=1)
    assert set(table.board.str.split(" ").str[0]) == {"T=0", "T=0.7"}  # separate boards
    one = table[(table.drafter == "good") & (table.temperature == 0) & (table["shape"] == "chain(4)")
                & (table.quant == "none")]
    overall = one[one.category == "overall"].iloc[0]
    assert overall.mal == pytest.approx(1 + (3 + 6 + 9 + 12) / 40)  # pooled over turns, not averaged
    assert overall.speedup == pytest.approx((4 * 32 / 4.6) / (4 * 32 / (4 * 2.1)))
    assert overall.speedup_quant == pytest.approx(2.0)  # the plain loop runs in half the reference's time
    assert overall.speedup_compound == pytest.approx(overall.speedup * overall.speedup_quant)
    assert overall.speedup_compound_lo <= overall.speedup_compound <= overall.speedup_compound_hi
    assert overall.mal_lo < overall.mal < overall.mal_hi
    assert overall.speedup_lo <= overall.speedup <= overall.speedup_hi
    code = one[one.category == "code"].iloc[0]
    assert code.mal == pytest.approx(1 + 9 / 20) and code.questions == 2
    # Every `good` entry outranks every `poor` one on MAL, in every board and category.
    for _, part in table.groupby(["board", "category"]):
        assert part[part.drafter == "good"].rank_mal.max() < part[part.drafter == "poor"].rank_mal.min()


def test_identical_questions_give_a_zero_width_interval(tmp_path):
    s = ResultsStore(tmp_path / "r")
    lab = labels("d", "chain(4)", "none", 32.0, 0.0)
    s.write_cell("c", {}, [{**lab, **make_row(f"q{i}", "chat", 8, 8, 1.0, 2.0)} for i in range(3)])
    row = build_table(load_rows(tmp_path / "r"), n_boot=200).iloc[0]
    assert row.mal_lo == row.mal == row.mal_hi == 2.0
    assert row.speedup_lo == pytest.approx(2.0) and row.speedup_hi == pytest.approx(2.0)


def test_acceptance_curve_is_pooled_by_counts():
    rows = pd.DataFrame({"reached_by_depth": [[4, 2], [6]], "accepted_by_depth": [[2, 1], [3]]})
    assert acceptance_curve(rows) == [pytest.approx(5 / 10), pytest.approx(1 / 2)]


def test_outputs_and_cli(store, tmp_path):
    markdown, out = write_leaderboard(store, tmp_path / "board", n_boot=100)
    assert markdown.count("### Ranked by MAL") == 2
    assert markdown.count("### Ranked by end-to-end speed over fp32 plain (compound)") == 2
    assert markdown.count("### Ranked numerics only") == 2  # rtn4 rows apart, never ranked by speed
    board = markdown.split("### Ranked by end-to-end speed")[1].split("### Ranked by MAL")[0]
    assert "rtn4_g64" not in board and "| 1 | good |" in board
    assert "### Per category: MAL / speculation speedup" in markdown and "| chat | code |" in markdown
    table = pd.read_csv(out / "leaderboard.csv")
    assert len(table) == 2 * 8 * 3  # 2 boards x 8 entries x (overall + 2 categories)
    assert (table[table.quant == "rtn4_g64"].rank_compound == 0).all()
    real = table[table.quant == "none"].groupby(["board", "category"]).rank_compound
    assert (real.min() == 1).all() and (real.max() <= 4).all()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["acceptance_T0.7s0_m_suite-abcdef_32.png", "acceptance_T0s0_m_suite-abcdef_32.png",
                    "heatmap_T0.7s0_m_suite-abcdef_32.png", "heatmap_T0s0_m_suite-abcdef_32.png"]
    cli = subprocess.run([sys.executable, "-m", "experiments.leaderboard", str(store), "--bootstrap", "50"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("# specdec leaderboard")
    assert "## T=0.7 top_k=0 top_p=1 seed=0 | m | dataset suite" in cli.stdout
    assert (store / "leaderboard" / "leaderboard.md").exists()


def test_not_a_store_or_an_empty_store(tmp_path):
    with pytest.raises(StoreError, match="not a specdec results store"):
        load_rows(tmp_path)
    ResultsStore(tmp_path / "empty")
    with pytest.raises(StoreError, match="no finished cells"):
        write_leaderboard(tmp_path / "empty")


def test_cli_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, capsys):
    from experiments.leaderboard import main as leaderboard_cli

    for path in (tmp_path / "nonexistent", tmp_path):
        assert leaderboard_cli([str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("leaderboard: error:") and "not a specdec results store" in err[0]


def test_rows_without_a_reference_run_still_rank(tmp_path):
    s = ResultsStore(tmp_path / "r")
    lab = labels("d", "chain(4)", "none", 32.0, 0.0)
    old = [{k: v for k, v in {**lab, **make_row(f"q{i}", "chat", 8, 8, 1.0, 2.0)}.items()
            if not k.startswith("reference_")} for i in range(3)]
    s.write_cell("c", {}, old)
    row = build_table(load_rows(tmp_path / "r"), n_boot=50).iloc[0]
    assert row.speedup == pytest.approx(2.0) and pd.isna(row.speedup_quant) and pd.isna(row.speedup_compound_lo)
