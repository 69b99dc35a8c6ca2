"""The findings report on synthetic stores whose rows agree exactly with their latency curves: the
verdict labels the intervals support, the cost model's zero error there, determinism, the JSON line,
projections, and bad input (cells without curves, unknown devices, curve files of the wrong schema)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.report import ReportError, main as report_cli, write_report
from experiments.store import ResultsStore
from specdec.measure.latency import LatencyCurve

SIZES = {"params": 1.35e8, "weight_bytes": 5.4e8, "layers": 30, "hidden": 576, "kv_heads": 3, "head_dim": 64,
         "kv_bytes_per_element": 4}


def curve(label: str, a: float, b: float) -> dict:
    """A latency curve L(w) = a + b w (every context), as the runner stores it."""
    widths = (1, 2, 4, 8, 16, 32)
    return LatencyCurve(target=label, device="cpu", dtype="float32", machine="test", threads=1, widths=widths,
                        contexts=(64, 256), seconds=tuple(tuple(a + b * w for w in widths) for _ in range(2))).to_json()


KERNELS = {"none": (0.1, 0.005), "bf16": (0.09, 0.004), "torchao_int4_g32": (0.05, 0.03), "rtn4_g64": (0.1, 0.005)}


def rows_for(quant: str, mals: list[float], width: int = 5, draft_s: float = 0.01) -> list[dict]:
    """Rows whose times are exactly the curves': drafted = prefill + draft + steps * L(width)."""
    (a, b), (ra, rb) = KERNELS[quant], KERNELS["none"]
    rows = []
    for i, mal in enumerate(mals):
        steps = 16
        tokens = round(steps * mal)
        accepted = tokens - steps
        verify, base_verify, ref_verify = steps * (a + b * width), tokens * (a + b), tokens * (ra + rb)
        rows.append({
            "question_id": f"q{i}", "category": "chat", "turn": 1, "prompt_tokens": 60, "new_tokens": tokens,
            "steps": steps, "accepted_tokens": accepted, "mal": tokens / steps, "mean_accepted_tokens": accepted / steps,
            "verify_widths": {str(width): steps}, "reached_by_depth": [steps] * (width - 1),
            "accepted_by_depth": [min(steps, max(0, accepted - d * steps // 2)) for d in range(width - 1)],
            "draft_time_s": steps * draft_s, "verify_time_s": verify, "prefill_time_s": 0.2,
            "wall_time_s": 0.2 + steps * draft_s + verify,
            "baseline_new_tokens": tokens, "baseline_steps": tokens, "baseline_verify_time_s": base_verify,
            "baseline_prefill_time_s": 0.2, "baseline_wall_time_s": 0.2 + base_verify,
            "reference_new_tokens": tokens, "reference_steps": tokens, "reference_verify_time_s": ref_verify,
            "reference_prefill_time_s": 0.2, "reference_wall_time_s": 0.2 + ref_verify,
            "same_tokens_as_baseline": True,
        })
    return rows


def write_cell(store: ResultsStore, drafter: str, quant: str, mals: list[float], with_curves: bool = True,
               diverged: int = 0) -> str:
    """One cell; its first `diverged` turns' drafted output left the plain loop's."""
    cid = f"{drafter}__{quant}"
    labels = {"cell_id": cid, "model": "m", "drafter": drafter, "shape": "chain(4)", "quant": quant,
              "bits": 4.0 if "4" in quant else 32.0, "numerics_only": quant.startswith("rtn"), "dataset": "main",
              "dataset_source": "default", "prompts": "abcdef0123", "temperature": 0.0, "top_k": 0, "top_p": 1.0,
              "seed": 0, "max_new_tokens": 32}
    meta = {"labels": labels, "hardware": {"cpu": "Test CPU", "torch_threads": 1}, "versions": {"torch": "x"}}
    if with_curves:
        meta["latency"] = {"target": curve(f"m@{quant}" if quant != "none" else "m", *KERNELS[quant])}
        meta["model_sizes"] = {"target": SIZES}
        if quant != "none":
            meta["latency"]["reference"] = curve("m", *KERNELS["none"])
            meta["model_sizes"]["reference"] = SIZES
    rows = [{**labels, **row, "same_tokens_as_baseline": i >= diverged} for i, row in enumerate(rows_for(quant, mals))]
    store.write_cell(cid, meta, rows)
    return cid


MALS = [2.5, 2.25, 2.75, 2.5, 2.375]


@pytest.fixture
def store(tmp_path) -> Path:
    results = tmp_path / "results"
    s = ResultsStore(results)
    for quant in ("none", "bf16", "torchao_int4_g32", "rtn4_g64"):
        write_cell(s, "eagle", quant, MALS)
    return results


def test_verdicts_cost_model_and_json_line(store, capsys):
    assert report_cli([str(store), "--bootstrap", "200"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    verdict = out[:-1]
    assert 1 <= len(verdict) <= 15
    assert summary["cells"] == 4
    # A steep curve (int4: a wide verify costs much more than one token) takes speculation's gain away.
    assert summary["verdict"] == {"eagle chain(4)": {"bf16": "compound", "torchao_int4_g32": "fight"}}
    # The rows are exactly what the curves predict: the cost model has no error here.
    assert summary["cost_model"]["within_25pct"] == 1.0 and summary["cost_model"]["median_relative_error"] < 1e-6
    report = (store / "REPORT.md").read_text()
    assert "rtn4_g64 (numerics only)" in report and "Q4_1" in report and "CPU, not GPU" in report
    assert "Test CPU" in report
    assert sorted(p.name for p in store.glob("*.png")) == ["compound_heatmap.png", "latency.png",
                                                           "predicted_vs_measured.png"]


def test_token_identity_is_reported_per_cell(tmp_path):
    """A bf16 cell whose drafted output left the plain loop's in 2 of 5 turns: 60% in its row of the
    table and named in the verdict; the fp32 cell 100%. Without divergence the verdict says so."""
    for diverged, line in ((0, "- Token identity: every cell"), (2, "- Token identity: 1 of 2 cells (bf16)")):
        results = tmp_path / f"results{diverged}"
        s = ResultsStore(results)
        write_cell(s, "eagle", "none", MALS)
        write_cell(s, "eagle", "bf16", MALS, diverged=diverged)
        report = write_report(results, n_boot=50)
        assert any(v.startswith(line) for v in report.verdict), report.verdict
    table = [t for t in (results / "REPORT.md").read_text().splitlines() if t.startswith("| eagle | `chain(4)`")]
    assert table[0].endswith("| 100% |") and table[1].startswith("| eagle | `chain(4)` | bf16 |"), table
    assert table[1].endswith("| 60% |"), table


def test_rerunning_gives_the_same_files(store):
    write_report(store, n_boot=100, devices=("H200",))
    first = {p.name: p.read_bytes() for p in sorted(store.glob("*")) if p.is_file() and p.suffix in (".md", ".png")}
    write_report(store, n_boot=100, devices=("H200",))
    assert {p.name: p.read_bytes() for p in sorted(store.glob("*")) if p.is_file() and p.suffix in (".md", ".png")} == first
    assert "roofline H200" in first["REPORT.md"].decode()


def test_no_entry_reliably_faster_is_said(tmp_path):
    s = ResultsStore(tmp_path / "r")
    write_cell(s, "poor", "none", [1.0, 1.0625, 1.0, 1.0625])
    report = write_report(tmp_path / "r", n_boot=100)
    assert any("No entry is reliably faster than plain decoding" in line for line in report.verdict)


def test_projection_from_a_curve_file(store, tmp_path):
    path = tmp_path / "gpu.json"
    LatencyCurve.from_json({**curve("m", 0.01, 0.0001), "machine": "Some GPU"}).save(path)
    LatencyCurve.from_json({**curve("m@torchao_int4_g32", 0.008, 0.0001), "machine": "Some GPU"}).save(tmp_path / "g4.json")
    write_report(store, n_boot=50, curve_files=(str(path), str(tmp_path / "g4.json")))
    assert "curve file Some GPU: speculation / compound" in (store / "REPORT.md").read_text()


def test_cells_without_latency_curves_are_named(tmp_path):
    s = ResultsStore(tmp_path / "r")
    write_cell(s, "eagle", "none", MALS)
    write_cell(s, "old", "torchao_int4_g32", MALS, with_curves=False)
    with pytest.raises(ReportError, match=r"1 cell\(s\).*lack the latency curves.*old__torchao_int4_g32.*Rerun"):
        write_report(tmp_path / "r", n_boot=10)


@pytest.mark.parametrize("args, message", [
    (["nonexistent"], "not a specdec results store"),
    (["STORE", "--project-device", "tpu"], "known devices: H200"),
    (["STORE", "--project-curve", "BAD"], "is not a latency curve"),
])
def test_cli_bad_input_is_one_line_and_a_nonzero_exit(store, tmp_path, capsys, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text('{"widths": [1]}')
    paths = {"STORE": str(store), "BAD": str(bad), "nonexistent": str(tmp_path / "nonexistent")}
    argv = [paths.get(a, a) for a in args]
    assert report_cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("report: error:") and message in err[0]


def test_a_store_of_several_settings_is_refused(store):
    s = ResultsStore(store)
    cid = write_cell(s, "other", "none", MALS)
    rows = (store / "cells" / cid / "rows.jsonl").read_text().replace('"max_new_tokens": 32', '"max_new_tokens": 64')
    (store / "cells" / cid / "rows.jsonl").write_text(rows)
    with pytest.raises(ReportError, match="holds 2 settings"):
        write_report(store, n_boot=10)
