"""The findings report on synthetic paired stores whose rows agree with their latency curves up to a
seeded jitter: verdict rules with a known answer (an A/A control reads compound, a steep kernel fights,
noise is inconclusive with a prompt count), the held-out cost model against both nulls, the JSON line,
unpaired cells refused, determinism, figures without warnings, projections that need a measured
overhead, and bad input."""

from __future__ import annotations

import json
import shutil
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import pandas as pd

from experiments.leaderboard import write_leaderboard
from experiments.predict import predict_control
from experiments.report import ReportError, load_cells, main as report_cli, write_report
from experiments.verdict import classify, interaction, prompts_to_settle
from experiments.store import ResultsStore
from specdec.core.curve import LatencyCurve

SIZES = {"params": 1.35e8, "weight_bytes": 5.4e8, "layers": 30, "hidden": 576, "kv_heads": 3, "head_dim": 64,
         "kv_bytes_per_element": 4}


def curve(label: str, a: float, b: float) -> dict:
    """A latency curve L(w) = a + b w (every context), as the runner stores it."""
    widths = (1, 2, 4, 8, 16, 32)
    return LatencyCurve(target=label, device="cpu", dtype="float32", machine="test", threads=1, widths=widths,
                        contexts=(64, 256), seconds=tuple(tuple(a + b * w for w in widths) for _ in range(2))).to_json()


KERNELS = {"none": (0.1, 0.005), "fp32_again": (0.1, 0.005), "bf16": (0.09, 0.004),
           "torchao_int4_g32": (0.05, 0.03), "rtn4_g64": (0.1, 0.005)}


def rows_for(quant: str, mals: list[float], width: int = 5, draft_s: float = 0.01, jitter: float = 0.02,
             paired: bool = True, profile: tuple[list[int], list[int]] | None = None,
             extra: dict | None = None) -> list[dict]:
    """Paired rows whose times are the curves' (drafted = prefill + draft + steps * L(width), plain =
    prefill + tokens * L(1)), each run of each question scaled by its own factor in [1 - jitter, 1 + jitter]
    (seeded), the fp32 runs on the fp32 curve; `profile` (reached, accepted per depth) is each row's
    acceptance profile (`tf_*_by_depth`)."""
    (a, b), (ra, rb) = KERNELS[quant], KERNELS["none"]
    rng = np.random.default_rng(len(quant))
    rows = []
    for i, mal in enumerate(mals):
        steps = 16
        tokens = round(steps * mal)
        accepted = tokens - steps
        f = 1 + rng.uniform(-jitter, jitter, size=4)

        def run(prefix: str, scale: float, forwards: dict, verify: float, other: float) -> dict:
            n = sum(forwards.values())
            return {f"{prefix}new_tokens": tokens, f"{prefix}steps": n, f"{prefix}verify_widths": forwards,
                    f"{prefix}accepted_tokens": tokens - n, f"{prefix}verify_time_s": scale * verify,
                    f"{prefix}prefill_time_s": scale * 0.2, f"{prefix}wall_time_s": scale * (0.2 + other + verify)}

        row = {"question_id": f"q{i}", "category": "chat", "turn": 1, "prompt_tokens": 60, "mal": tokens / steps,
               "mean_accepted_tokens": accepted / steps, "reached_by_depth": [steps] * (width - 1),
               "accepted_by_depth": [min(steps, max(0, accepted - d * steps // 2)) for d in range(width - 1)],
               "draft_time_s": steps * draft_s, "same_tokens_as_baseline": True,
               "same_tokens_as_reference": quant in ("none", "fp32_again") or i % 2 == 0, "tf_mal": tokens / steps,
               **run("", f[0], {str(width): steps}, steps * (a + b * width), steps * draft_s),
               **run("baseline_", f[1], {"1": tokens}, tokens * (a + b), 0.0),
               **run("reference_", f[2], {"1": tokens}, tokens * (ra + rb), 0.0)}
        if paired:
            row.update(run("reference_drafted_", f[3], {str(width): steps}, steps * (ra + rb * width), steps * draft_s))
        if profile is not None:
            row.update(tf_reached_by_depth=profile[0], tf_accepted_by_depth=profile[1])
        rows.append(row | (extra or {}))
    return rows


def write_cell(store: ResultsStore, drafter: str, quant: str, mals: list[float], with_curves: bool = True,
               diverged: int = 0, paired: bool = True, jitter: float = 0.02, k: int = 4, draft_s: float = 0.01,
               profile: tuple[list[int], list[int]] | None = None, extra: dict | None = None) -> str:
    """One chain(k) cell; its first `diverged` turns' drafted output left the plain loop's."""
    cid = f"{drafter}__{quant}" + (f"__chain{k}" if k != 4 else "")
    labels = {"cell_id": cid, "model": "m", "drafter": drafter, "shape": f"chain({k})", "quant": quant,
              "bits": 4.0 if "4" in quant else 32.0, "numerics_only": quant.startswith("rtn"),
              "control": quant == "fp32_again", "dataset": "main",
              "dataset_source": "default", "prompts": "abcdef0123", "temperature": 0.0, "top_k": 0, "top_p": 1.0,
              "seed": 0, "max_new_tokens": 32}
    meta = {"labels": labels, "hardware": {"cpu": "Test CPU", "torch_threads": 1}, "versions": {"torch": "x"},
            "target_info": {"source": "/wheel/SmolLM2-135M-Instruct.Q4_1.gguf"} if with_curves else {}}
    own = "none" if quant == "fp32_again" else quant
    if with_curves:
        meta["latency"] = {"target": curve(f"m@{own}" if own != "none" else "m", *KERNELS[quant])}
        meta["model_sizes"] = {"target": SIZES}
        if quant != "none":
            meta["latency"]["reference"] = curve("m", *KERNELS["none"])
            meta["model_sizes"]["reference"] = SIZES
    rows = [{**labels, **row, "same_tokens_as_baseline": i >= diverged}
            for i, row in enumerate(rows_for(quant, mals, width=k + 1, draft_s=draft_s, paired=paired, jitter=jitter,
                                             profile=profile, extra=extra))]
    store.write_cell(cid, meta, rows)
    return cid


MALS = [2.5, 2.25, 2.75, 2.5, 2.375, 2.5, 2.625, 2.25]


@pytest.fixture
def store(tmp_path) -> Path:
    results = tmp_path / "results"
    s = ResultsStore(results)
    for quant in ("none", "fp32_again", "bf16", "torchao_int4_g32", "rtn4_g64"):
        write_cell(s, "eagle", quant, MALS)
    return results


def test_verdicts_control_cost_model_and_json_line(store, capsys):
    assert report_cli([str(store), "--bootstrap", "400"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    verdict = out[:-1]
    # The limits line is read from the store: the model's size and source, the device and threads, the text confound.
    assert 1 <= len(verdict) <= 15 and verdict[1].startswith("- Limits: a 135M-parameter model (m), on CPU (1 torch ")
    assert "weights from a Q4_1 GGUF (so 4-bit requantization" in verdict[1] and "write different text" in verdict[1]
    assert summary["cells"] == 5
    # fp32 measured again under another label: no interaction, within the margin.
    assert summary["control"] == "compound"
    assert any(v.startswith("- A/A control (eagle chain(4) on fp32_again") and "target compound met" in v for v in verdict)
    # Every headline with a target says whether it is met (the cost model's here).
    assert any(v.startswith("- Cost model out of sample, target") and ("met:" in v) for v in verdict)
    # A steep curve (int4: a wide verify costs much more than one token) takes speculation's gain away;
    # bf16's curve has fp32's shape. Numerics-only rtn4 gets no speed verdict.
    assert summary["verdict"] == {"eagle chain(4) on bf16": "compound", "eagle chain(4) on torchao_int4_g32": "fight"}
    cost = summary["cost_model"]
    assert set(cost["null_median_error"]) == {"constant", "flat_curve", "transfer"}
    # Times are the curves' up to 2% jitter: held out, the model lands within 25% everywhere and beats
    # both nulls (the flat curve misses int4's steep curve, the constant misses every speedup).
    assert cost["heldout_within_25pct"] == 1.0 and cost["heldout_median_error"] < 0.1
    assert cost["heldout_median_error"] < cost["null_median_error"]["flat_curve"]
    assert cost["heldout_median_error"] < cost["null_median_error"]["constant"]
    # No other cell measured bf16 or int4 (their kernel predictions would read their own curves) and the A/A
    # control's is its twin: no held-out kernel is scored (`test_the_cost_model_borrows_...` scores one).
    assert set(cost["by_kind"]) == {"prompts"} and "A/A-twin or own-curve" in cost["absent"]["kernel"]
    assert cost["curves"]["eagle chain(4) on bf16"].startswith("own curve")
    assert cost["curves"]["eagle chain(4) on fp32_again"] == "eagle chain(4) on bf16's reference curve"
    # One shape per drafter x kernel: no held-out shape, and the JSON line says why (never a zero).
    assert "chain shorter than another chain" in cost["absent"]["shape"]
    assert all(set(k) >= {"within_25pct", "median_error", "null_median_error", "null_within_25pct",
                          "mal_median_error", "in_sample_median_error"} for k in cost["by_kind"].values())
    # The prompts' MAL error, and what their spread expects of it, are shown apart from the score.
    assert "expected_mal_median_error" in cost["by_kind"]["prompts"]
    report = (store / "REPORT.md").read_text()
    assert "### Numerics only" in report and "rtn4_g64 (numerics only)" in report and "Test CPU" in report
    assert "teacher-forced MAL" in report and "T_d = P + N * sum_w phi_w" in report
    # Whether the target is met, pooled and per kind, is said where the numbers are.
    met = {True: "yes", False: "no"}
    assert f"median error: {'met' if cost['beats_nulls'] else 'not met'});" in report
    assert all(f"| held-out {kind} | {k['n']} ({k['independent']}) |" in report
               and report.split(f"| held-out {kind} | ")[1].split("\n")[0].endswith(f"| {met[k['beats_nulls']]} |")
               for kind, k in cost["by_kind"].items())
    assert sorted(p.name for p in store.glob("*.png")) == ["compound_heatmap.png", "decomposition.png", "heldout.png",
                                                           "interactions.png", "latency.png"]
    assert all((f"**Held-out {kind} fails its nulls.**" in report) != k["beats_nulls"]
               for kind, k in cost["by_kind"].items())


def test_the_decomposition_multiplies_to_the_interaction_and_finds_the_width(store, capsys):
    """int4's verify step at width 5 costs (0.05 + 5 * 0.03) / 0.08 = 2.5 plain steps against fp32's
    0.125 / 0.105 = 1.19, drafting 10 ms a step on both, the same tokens per step on both: the fight is
    width first, drafting (a larger share of int4's faster step) second, and acceptance is exactly 1."""
    assert report_cli([str(store), "--bootstrap", "300"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    parts = summary["decomposition"]
    assert set(parts) == {"eagle chain(4) on bf16", "eagle chain(4) on torchao_int4_g32", "eagle chain(4) on fp32_again"}
    for name, d in parts.items():
        assert np.prod([d[k] for k in ("mal", "width", "drafting", "prefill")]) == pytest.approx(d["interaction"], rel=1e-3)
        assert d["interaction"] == pytest.approx(summary["interaction"][name][0], rel=1e-3)
        assert all(lo <= d[k] <= hi for k, (lo, hi) in d["ci"].items())
    int4 = parts["eagle chain(4) on torchao_int4_g32"]
    assert int4["mal"] == pytest.approx(1.0) and int4["ci"]["mal"] == pytest.approx([1.0, 1.0])
    assert int4["r_kernel"] == pytest.approx(2.5, rel=0.05) and int4["r_fp32"] == pytest.approx(0.125 / 0.105, rel=0.05)
    assert int4["width"] < int4["drafting"] < 1.0 and int4["ci"]["width"][1] < 1.0
    assert int4["decode"] < int4["interaction"]  # the shared prefill dilutes the fight end to end
    control = parts["eagle chain(4) on fp32_again"]
    assert all(abs(control[k] - 1) < 0.05 for k in ("mal", "width", "drafting", "prefill"))
    assert "## Why: the interaction decomposed" in (store / "REPORT.md").read_text()


def test_a_drafter_variant_is_its_own_row_and_decomposition(store, capsys):
    """`eagle[head_quant]` on int4 beside `eagle` (experiments.run.drafter_label): its own verdict, decomposition and
    JSON entry; a head that drafts in half the time on the kernel gives a drafting factor nearer 1."""
    write_cell(ResultsStore(store), "eagle[head_quant]", "torchao_int4_g32", MALS, draft_s=0.005)
    assert report_cli([str(store), "--bootstrap", "300"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plain, variant = (summary["decomposition"][f"{d} chain(4) on torchao_int4_g32"] for d in ("eagle", "eagle[head_quant]"))
    assert summary["verdict"]["eagle[head_quant] chain(4) on torchao_int4_g32"] == "fight"
    assert plain["drafting"] < variant["drafting"] < 1.0
    assert "| eagle[head_quant] | `chain(4)` | torchao_int4_g32 |" in (store / "REPORT.md").read_text()


def test_a_smaller_chain_is_predicted_from_a_deeper_chains_profile(tmp_path, capsys):
    """int4 chain(4) with an acceptance profile replayed in chain(2) at MAL 1 + 13 / 10 = 2.3 and a drafting
    probe {1: 4 ms, 4: 10 ms} (chain(2) drafts 0.6 of chain(4)'s time), and an int4 chain(2) cell run at that
    MAL on the curve with that drafting time: the held-out shape lands within a few % while the flat curve
    misses int4's steep curve."""
    results = tmp_path / "results"
    s = ResultsStore(results)
    write_cell(s, "eagle", "none", MALS)
    write_cell(s, "eagle", "torchao_int4_g32", MALS, profile=([100] * 4, [90, 70, 30, 15]),
               extra={"tf_chain_steps": [14, 10, 9, 8], "tf_chain_accepted": [8, 13, 15, 17],
                      "draft_probe_s": {"1": 0.004, "4": 0.010}})
    write_cell(s, "eagle", "torchao_int4_g32", [2.3] * 8, k=2, draft_s=0.006)
    assert report_cli([str(results), "--bootstrap", "100"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    shape = json.loads(out[-1])["cost_model"]["by_kind"]["shape"]
    assert shape["n"] == 1 and shape["median_error"] < 0.05
    assert shape["median_error"] < shape["null_median_error"]["flat_curve"] / 2
    assert shape["median_error"] < shape["null_median_error"]["constant"]
    assert any("shape" in line for line in out if line.startswith("- Cost model out of sample"))
    report = (results / "REPORT.md").read_text()
    assert "| held-out shape | 1 (1) |" in report
    assert "| eagle `chain(2)` torchao_int4_g32 | held-out shape from chain(4) on torchao_int4_g32 |" in report
    assert re.search(r"\| 2\.30 / 2\.31 \| \d+% \| 1\.00 \|", report)  # MAL used (the replay) / measured,
    # the in-sample error, tokens drafted / plain


def test_verdict_rules_have_a_known_answer():
    assert classify(0.70, 0.95) == "fight"
    assert classify(0.90, 1.20) == "compound" and classify(1.02, 1.10) == "compound"
    assert classify(0.85, 1.05) == "inconclusive" and classify(0.80, 0.99) == "fight"
    assert classify(0.95, 1.0) == "compound"  # equivalence: no loss beyond the 10% margin
    assert prompts_to_settle(1.0, 0.95, 1.05, 10) is None
    # Worked example of the docstring: point 0.95 [0.80, 1.10] on 8 prompts -> ~70.
    assert 60 <= prompts_to_settle(0.95, 0.80, 1.10, 8) <= 80
    # More spread needs more prompts; a wider margin from the rule needs fewer.
    assert prompts_to_settle(1.0, 0.7, 1.4, 8) > prompts_to_settle(1.0, 0.85, 1.15, 8) > 8


def test_interaction_of_synthetic_cells():
    rng = np.random.default_rng(0)
    aa = pd.DataFrame(rows_for("fp32_again", MALS * 2))
    assert interaction(aa, 500, rng).label == "compound"
    noisy = pd.DataFrame(rows_for("fp32_again", MALS, jitter=0.3))
    result = interaction(noisy, 500, rng)
    assert result.label == "inconclusive" and result.settle > len(MALS)
    assert "prompts would settle it" in result.text()
    assert interaction(pd.DataFrame(rows_for("torchao_int4_g32", MALS)), 500, rng).label == "fight"


def test_an_unpaired_store_is_refused_never_judged(tmp_path):
    s = ResultsStore(tmp_path / "r")
    write_cell(s, "eagle", "none", MALS)
    cid = write_cell(s, "eagle", "torchao_int4_g32", MALS, paired=False)
    with pytest.raises(ReportError, match=f"lack the latency curves or the reference run the report needs \\({cid}\\)"):
        write_report(tmp_path / "r", n_boot=100)


def test_token_identity_and_same_text(tmp_path):
    """A bf16 cell whose drafted output left the plain loop's in 2 of 8 turns: 75% in its row; half its
    prompts write fp32's plain text (the synthetic rows say so), which the verdict names."""
    results = tmp_path / "results"
    s = ResultsStore(results)
    write_cell(s, "eagle", "none", MALS)
    write_cell(s, "eagle", "bf16", MALS, diverged=2)
    report = write_report(results, n_boot=50)
    assert any(v.startswith("- Same plain text as fp32: bf16 50%") for v in report.verdict), report.verdict
    table = [t for t in (results / "REPORT.md").read_text().splitlines() if t.startswith("| eagle | `chain(4)` | bf16 |")]
    assert table[-1].endswith("| 75% |"), table


def test_rerunning_gives_the_same_files(store):
    write_report(store, n_boot=100)
    first = {p.name: p.read_bytes() for p in sorted(store.glob("*")) if p.is_file() and p.suffix in (".md", ".png")}
    write_report(store, n_boot=100)
    assert {p.name: p.read_bytes() for p in sorted(store.glob("*")) if p.is_file() and p.suffix in (".md", ".png")} == first


def test_figures_of_any_grid_size_raise_no_warning(tmp_path):
    s = ResultsStore(tmp_path / "one")
    write_cell(s, "e", "torchao_int4_g32", MALS[:4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_report(tmp_path / "one", n_boot=20)
        write_leaderboard(tmp_path / "one", n_boot=20)


def test_projection_needs_a_measured_overhead(store, tmp_path):
    report = write_report(store, n_boot=50, devices=("H200",))
    assert "roofline H200 dropped: no measured per-forward overhead" in (store / "REPORT.md").read_text()
    h200 = tmp_path / "h200.json"
    LatencyCurve.from_json({**curve("m", 0.035, 0.0001), "machine": "NVIDIA H200"}).save(h200)
    write_report(store, n_boot=50, devices=(f"H200={h200}",))
    assert "| roofline H200 |" in (store / "REPORT.md").read_text()
    cpu = tmp_path / "cpu.json"
    LatencyCurve.from_json(curve("m", 0.1, 0.001)).save(cpu)
    with pytest.raises(ValueError, match="measured on 'test', not on a H200"):
        write_report(store, n_boot=50, devices=(f"H200={cpu}",))
    assert report.summary["cells"] == 5


def test_projection_from_a_curve_file(store, tmp_path):
    path = tmp_path / "gpu.json"
    LatencyCurve.from_json({**curve("m", 0.01, 0.0001), "machine": "Some GPU"}).save(path)
    LatencyCurve.from_json({**curve("m@torchao_int4_g32", 0.008, 0.0001), "machine": "Some GPU"}).save(tmp_path / "g4.json")
    write_report(store, n_boot=50, curve_files=(str(path), str(tmp_path / "g4.json")))
    assert "| curve file Some GPU |" in (store / "REPORT.md").read_text()


def test_cells_without_latency_curves_are_named(tmp_path):
    s = ResultsStore(tmp_path / "r")
    write_cell(s, "eagle", "none", MALS)
    write_cell(s, "old", "torchao_int4_g32", MALS, with_curves=False)
    with pytest.raises(ReportError, match=r"1 cell\(s\).*lack the latency curves.*old__torchao_int4_g32.*Rerun"):
        write_report(tmp_path / "r", n_boot=10)


def test_two_cells_for_one_entry_are_refused(store):
    meta = json.loads((store / "cells" / "eagle__bf16" / "cell.json").read_text())
    rows = [json.loads(line) for line in (store / "cells" / "eagle__bf16" / "rows.jsonl").read_text().splitlines()]
    ResultsStore(store).write_cell("eagle__bf16__older", meta, [{**r, "cell_id": "eagle__bf16__older"} for r in rows])
    with pytest.raises(ReportError, match="two cells for eagle chain\\(4\\) on bf16"):
        write_report(store, n_boot=10)


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


def test_the_kv_curve_reaches_the_verdict_the_report_and_the_json_line(store, capsys):
    base = {"kind": "summary", "prompt_tokens": 2100, "retention": None, "kv": None, "seconds_per_token": 0.1,
            "acceptance": None, "kv_bytes_per_token": None, "kv_bytes": None, "draft_forward_s": None}
    rows = [{**base, "prompt": f"p{i}", "policy": p} for i in range(4) for p in ("plain", "plain2")] + [
        {**base, "prompt": f"p{i}", "policy": "window", "retention": 0.25, "kv": "window(sink=4,recent=521)",
         "seconds_per_token": 0.2, "acceptance": 0.5, "kv_bytes_per_token": 100.0, "kv_bytes": 2e5,
         "draft_forward_s": 0.06} for i in range(4)]
    settings = {"source": "long2k", "prompts": 4, "min_tokens": 2100, "max_tokens": 2100, "new_tokens": 16,
                "cpu": "cpu", "threads": 1, "seconds": 1.0}
    (store / "kv_curve.json").write_text(json.dumps({"settings": settings, "rows": rows}))
    assert report_cli([str(store), "--bootstrap", "200"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    kv = json.loads(out[-1])["kv"]
    assert kv["verdicts"] == {"window": {"acceptance_free": None, "pays_in_time": None}} and kv["control"] == "within"
    assert kv["rows"][0]["speedup"] == pytest.approx(0.5)
    assert any(line.startswith("- KV compression (self_draft chain(4), 4 prompts")
               and line.endswith("(control target within: met)") for line in out[:-1])
    report = (store / "REPORT.md").read_text()
    assert "## The KV question" in report and "| window | 25% | `window(sink=4,recent=521)` |" in report
    assert "## Speculation against batch size" not in report  # one batch size: no batch section


def test_the_console_the_report_and_the_leaderboard_print_one_interval(store):
    """Each cell's bootstrap is drawn once and stored with it: the cell's console line, REPORT.md's
    speedup table and the leaderboard print the same MAL and speedup intervals, whichever reads first."""
    from experiments.leaderboard import cell_summary

    s = ResultsStore(store)
    write_report(store)
    board, _ = write_leaderboard(store)
    report = (store / "REPORT.md").read_text()
    number = r"(\d+\.\d\d)"
    for cid in s.cell_ids():
        assert (store / "cells" / cid / "stats.json").is_file()
        console = cell_summary(s, cid)
        drafter, quant = cid.split("__")[:2]
        for label, key in (("MAL", "mal"), ("speculation", "speedup"), ("compound", "speedup_compound")):
            got = re.search(rf"{label} {number}x? \[{number}, {number}\]", console)
            assert got, (label, console)
            point, lo, hi = got.groups()
            row = next(line for line in report.splitlines() if line.startswith(f"| {drafter} | `chain(4)` | {quant} |")
                       and line.count("[") >= 4)  # the three-speedups table's row
            assert f"{point}{'' if key == 'mal' else 'x'} [{lo}, {hi}]" in row, (label, row)
            line = next(line for line in board.splitlines() if f"| {drafter} | `chain(4)` | {quant}" in line
                        and line.count("[") >= 4)
            assert f"{point} [{lo}, {hi}]" in line, (label, line)


def test_a_heatmap_shows_the_cells_present_not_a_mostly_blank_grid():
    from experiments.figures import compact

    grid = pd.DataFrame([[1.9, np.nan, np.nan], [np.nan, 1.8, 1.2]], index=["eagle chain(2)", "eagle chain(4)"],
                        columns=["none", "fp32_again", "rtn4"])
    got = compact(grid, numerics={"rtn4"})
    assert list(got.index) == ["eagle chain(2) on none", "eagle chain(4) on fp32_again", "eagle chain(4) on rtn4 *"]
    assert list(got[""]) == [1.9, 1.8, 1.2]
    full = grid.fillna(1.0).assign(empty=np.nan)  # a full grid keeps its shape, less its empty column
    assert compact(full).equals(full.drop(columns="empty"))


def test_the_limits_line_says_only_what_the_store_recorded(store):
    from experiments.report import _limits

    cells = [c for c in load_cells(store) if c.quant in ("none", "fp32_again")]
    assert _limits(cells) == ("Limits: a 135M-parameter model (m), on CPU (1 torch thread(s)), weights from a Q4_1 "
                              "GGUF (so 4-bit requantization is near-lossless).")  # no quantized cell: no text confound
    for c in cells:
        c.meta.pop("target_info"), c.meta.pop("model_sizes")
        c.meta["hardware"] = {"torch_threads": 8, "cuda": ["Some GPU"]}
    assert _limits(cells) == "Limits: model m, on GPU (8 torch thread(s))."


def test_the_mechanism_control_is_priced_at_its_own_held_out_widths(store, capsys):
    """With the control drafter's held-out fp32 runs in RESULTS/profile, the source cell's in-run R of each kernel,
    taken linear in the width, is priced at the control's widths: half its steps at width 1 (no proposal, no width
    cost) and half at the source's 5 give R = 1 + (R(5) - 1) / 2; a control that never proposes has no width cost."""
    from experiments.predict import PROFILE_DIR

    assert report_cli([str(store), "--bootstrap", "300"]) == 0
    source = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decomposition"][
        "eagle chain(4) on torchao_int4_g32"]
    half = lambda r: 1 + (r - 1) / 2  # noqa: E731
    for widths, expected in (({"1": 8, "5": 8}, half(source["r_fp32"]) / half(source["r_kernel"])), ({"1": 16}, 1.0)):
        profile = ResultsStore(store / PROFILE_DIR)
        write_cell(profile, "ngram", "none", MALS, extra={"verify_widths": widths})
        predicted = predict_control(store, "ngram", "eagle", "torchao_int4_g32")
        assert predicted["predicted"] == pytest.approx(expected, abs=2e-3) and "8 held-out prompts" in predicted["from"]
        assert expected == 1.0 or predicted["predicted"] != pytest.approx(source["width"], abs=1e-2)
        shutil.rmtree(store / PROFILE_DIR)


def test_the_mechanism_control_is_predicted_before_its_cell_exists_then_measured(store, capsys):
    """The prediction is the stored eagle int4 cell's width factor, written before the ngram cell is;
    the report then sets the ngram cell's measured interaction and CI beside it."""
    assert report_cli([str(store), "--bootstrap", "300"]) == 0
    width = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decomposition"][
        "eagle chain(4) on torchao_int4_g32"]["width"]
    with pytest.raises(ReportError, match="no decomposed self_draft cell"):
        predict_control(store, "ngram", "self_draft", "torchao_int4_g32")
    predicted = predict_control(store, "ngram", "eagle", "torchao_int4_g32")
    assert predicted["predicted"] == pytest.approx(width, abs=1e-3) and "torchao_int4_g32" in predicted["from"]
    write_cell(ResultsStore(store), "ngram", "torchao_int4_g32", MALS, draft_s=0.0005)
    assert report_cli([str(store), "--bootstrap", "300"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    control = json.loads(out[-1])["mechanism_control"]
    assert control["drafter"] == "ngram" and control["predicted"] == predicted["predicted"]
    assert control["ci"][0] <= control["measured"] <= control["ci"][1] < 1.0  # near-free drafting still fights
    assert any(line.startswith("- Mechanism control (ngram): predicted") for line in out[:-1])
