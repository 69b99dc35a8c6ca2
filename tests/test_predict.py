"""Predicted before measured (experiments/predict.py) and the cost model scored per kind on borrowed curves
(experiments/costs.py): synthetic stores from tests/test_report.py, no model."""

from __future__ import annotations

import json
import shutil

import pytest

from experiments import costs
from experiments.main import GRID_FILE, profile_command
from experiments.predict import PREDICTION_FILE, PROFILE_DIR, predict_cell
from experiments.report import build_report
from experiments.store import ResultsStore
from experiments.stored import load_cells
from tests.test_report import KERNELS, MALS, curve, write_cell

INT4 = "torchao_int4_g32"


def test_a_kernel_cell_is_predicted_from_held_out_prompts_and_curves_before_it_exists(tmp_path):
    results = tmp_path / "results"
    s = ResultsStore(results)  # as the main job opens it before anything runs
    write_cell(ResultsStore(results / PROFILE_DIR), "eagle", "none", [2.0, 2.25, 2.5, 2.25])  # other prompts, fp32
    records = {"kernel": {"curves": {"c": curve(f"m@{INT4}", *KERNELS[INT4])}},
               "fp32": {"curves": {"c": curve("m", *KERNELS["none"])}}}
    name = f"eagle chain(4) on {INT4}"
    before = predict_cell(results, name, "eagle", "chain(4)", records, {"kernel": "k.json", "fp32": "f.json"})
    assert (results / PREDICTION_FILE).exists() and before["predicted"] < 0.9 and "k.json" in before["from"]
    assert before["drafting_scale"] == 1.0 and "taken as equal" in before["from"]  # no head step in the records
    # With the head's draft step in both records, the kernel's drafting is scaled by their ratio: a cheaper draft
    # step on the kernel predicts less fight, a dearer one more, and ngram is never scaled.
    step = lambda s: {"g": {"dtype": "bfloat16", "seconds_per_step": {"bfloat16": s}}}  # noqa: E731
    scaled = {f: predict_cell(results, name, "eagle", "chain(4)", {"kernel": {**records["kernel"], "head_dtype": step(
        f * 0.01)}, "fp32": {**records["fp32"], "head_dtype": step(0.01)}}, {"kernel": "k", "fp32": "f"})
        for f in (0.5, 1.0, 2.0)}
    assert scaled[0.5]["predicted"] > scaled[1.0]["predicted"] == before["predicted"] > scaled[2.0]["predicted"]
    assert scaled[0.5]["drafting_scale"] == 0.5 and "draft step 5.0 / 10.0 ms" in scaled[0.5]["from"]
    assert predict_cell(results, f"ngram chain(4) on {INT4}", "eagle", "chain(4)", {"kernel": {
        **records["kernel"], "head_dtype": step(0.005)}, "fp32": records["fp32"]}, {"kernel": "k", "fp32": "f"})[
        "drafting_scale"] == 1.0
    (results / PREDICTION_FILE).write_text(json.dumps(before) + "\n")  # the report reads the last line per cell
    assert before["fp32_curve_over_runs"] == pytest.approx(1.0, abs=0.05)  # the profile's runs are the curve's
    for quant in ("none", INT4):
        write_cell(s, "eagle", quant, MALS)
    twin = tmp_path / "twin"  # the same prediction beside a cell measured otherwise: it never read the cell
    shutil.copytree(results, twin)
    shutil.rmtree(twin / "cells" / f"eagle__{INT4}")
    write_cell(ResultsStore(twin), "eagle", INT4, [m + 0.5 for m in MALS], draft_s=0.03)
    measured = []
    for store in (results, twin):
        markdown, _, summary, _ = build_report(store, n_boot=200)
        (p,) = summary["prediction"]
        assert p["cell"] == name and p["predicted"] == before["predicted"] and p["from"] == before["from"]
        assert p["ci"][0] <= p["measured"] <= p["ci"][1] and isinstance(p["within"], bool)
        # beside it, the interaction at equal acceptance: the measured one over the cell's own acceptance factor
        mal = summary["decomposition"][name]["mal"]
        assert p["at_equal_acceptance"][0] == pytest.approx(p["measured"] / mal, rel=1e-3)
        assert p["within_at_equal_acceptance"] == (p["at_equal_acceptance"][1] <= p["predicted"]
                                                   <= p["at_equal_acceptance"][2]
                                                   or abs(p["at_equal_acceptance"][0] - p["predicted"]) <= 0.05)
        measured.append(p["measured"])
        assert f"- Predicted before it ran, {name}: predicted {before['predicted']:.2f} (tune" in markdown
    assert measured[0] != measured[1]


def test_the_cost_model_borrows_another_cells_curve_and_keeps_the_twin_out(tmp_path):
    s = ResultsStore(tmp_path)
    for drafter, quant in (("eagle", "none"), ("eagle", "fp32_again"), ("eagle", INT4), ("ngram", INT4)):
        write_cell(s, drafter, quant, MALS, draft_s=0.01 if drafter == "eagle" else 0.001)
    cells = load_cells(tmp_path)
    result = costs.heldout_score(cells)
    kernel = result.score["by_kind"]["kernel"]
    assert kernel["n"] == kernel["independent"] == 2  # eagle and ngram on int4: the A/A twin is listed, not scored
    assert set(kernel["null_median_error"]) == {"constant", "flat_curve", "transfer"}
    assert result.score["curves"][f"eagle chain(4) on {INT4}"] == f"ngram chain(4) on {INT4}'s target curve"
    assert result.score["independent_predictions"] == 4 < result.score["predictions"]
    held = result.held.set_index(["cell_id", "kind"])
    twin = held.loc[("eagle__fp32_again", "kernel")]
    assert not twin.scored and twin.transfer == pytest.approx(twin.measured, rel=0.1)
    # The eagle cell's own stored curve is never read for its prediction; the ngram cell's (which borrows it) is.
    eagle = next(c for c in cells if c.cell_id == f"eagle__{INT4}")
    eagle.meta["latency"]["target"] = curve(f"m@{INT4}", 0.05, 0.3)
    again = costs.heldout_score(cells).held.set_index(["cell_id", "kind"])
    assert again.loc[(eagle.cell_id, "kernel")].predicted == held.loc[(eagle.cell_id, "kernel")].predicted
    assert again.loc[(f"ngram__{INT4}", "kernel")].predicted != held.loc[(f"ngram__{INT4}", "kernel")].predicted


def test_the_main_job_runs_the_held_out_profile_before_the_kernel_blocks():
    fixed = ["model=smollm2", "dataset=main", "max_new_tokens=64", "results.dir=R"]
    blocks = [["drafter=eagle", "shape=chain4", "quant=torchao_int4,fp32_again", *fixed],
              ["drafter=eagle", "shape=chain2", "quant=none", *fixed],
              ["drafter=ngram", "shape=chain4", "quant=torchao_int4", *fixed]]
    command = profile_command(blocks, GRID_FILE, "R")
    assert "drafter=eagle,ngram" in command and "quant=none" in command and "results.dir=R/profile" in command
    assert "dataset.source=chat_heldout" in command and not any(o.startswith("dataset=main") for o in command)


def test_the_main_job_prints_each_kernel_cells_prediction_before_its_block(tmp_path, monkeypatch, capsys):
    import specdec.tune
    from experiments.main import check_cells, predict_block

    write_cell(ResultsStore(tmp_path / PROFILE_DIR), "eagle", "none", MALS)
    records = {None: {"curves": {"c": curve("m", *KERNELS["none"])}}, INT4: {"curves": {"c": curve("m@4", 0.05, 0.03)}}}
    monkeypatch.setattr(specdec.tune, "stored_record", lambda name, threads, device, spec: (records[spec], f"/{spec}"))
    cells = check_cells([["drafter=eagle", "shape=chain4", "quant=torchao_int4,none"]])
    predict_block(cells, str(tmp_path), ["python", "-m", "specdec.tune", "m", "--threads", "1"], None, True)
    out = capsys.readouterr().out
    assert out.startswith(f"predicted before it runs: eagle chain(4) on {INT4}: interaction 0.")
    assert out.count("\n") == 1
    assert "fp32 forward is 1.00x the profile's" in out and (tmp_path / PREDICTION_FILE).exists()
