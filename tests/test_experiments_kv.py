"""The KV-retention curve (experiments/kv.py): retention -> policy specs, the verdict's rule on rows
with a known answer (and its A/A control), the curve on a tiny target (the full cache is the target
itself, a 4-bit cache is lossy), the report's KV section from a curve file and from a recorded full
sweep, the main job's `kv:` command, and the ledger prompts on the embedded tokenizer."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from experiments import kv
from specdec.measure import records

REPO = Path(__file__).resolve().parents[1]


def test_policy_spec_keeps_the_asked_share_of_the_prompt():
    assert kv.policy_spec("window", 0.05, 2000) == "window(sink=4,recent=96)"
    assert kv.policy_spec("snapkv", 0.25, 2000) == "snapkv(budget=500,window=32)"
    assert kv.policy_spec("quant4", 0.25, 2000) == "window(sink=4,recent=496)+quant(bits=4)"
    assert kv.policy_spec("quant4", 1.0, 2000) == "quant(bits=4)"
    assert kv.policy_spec("window", 1.0, 2000) == kv.policy_spec("full", 0.05, 2000) == "full"
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        kv.policy_spec("lru", 0.5, 100)


def rows_for(accept: dict[tuple[str, float], list[float]]) -> list[dict]:
    """Curve rows for prompts p0..: {(policy, retention): per-prompt acceptance}, TV = 1 - acceptance."""
    return [{"prompt": f"p{i}", "kind": "retrieval", "policy": policy, "retention": retention, "kv": policy,
             "accept": a, "tv": 1 - a, "kl": 0.0, "memory_fraction": retention, "mal": None}
            for (policy, retention), values in accept.items() for i, a in enumerate(values)]


KNOWN = {("full", 1.0): [1.0, 0.9, 1.0, 0.8], ("control", 1.0): [1.0, 0.9, 1.0, 0.8],
         ("window", 0.05): [0.5, 0.45, 0.6, 0.4], ("window", 0.25): [0.99, 0.9, 0.98, 0.8],
         ("window", 1.0): [1.0, 0.9, 1.0, 0.8],
         ("snapkv", 0.05): [0.99, 0.9, 1.0, 0.8], ("snapkv", 0.25): [0.7, 0.6, 0.8, 0.5],  # not monotone
         ("snapkv", 1.0): [1.0, 0.9, 1.0, 0.8],
         ("quant4", 0.25): [0.5] * 4, ("quant4", 1.0): [0.9, 0.8, 0.9, 0.7]}


def test_verdict_names_the_lowest_retention_within_the_margin_at_every_larger_one():
    found = kv.verdict(rows_for(KNOWN), n_boot=500)
    assert found["lowest"] == {"window": 0.25, "snapkv": 1.0, "quant4": None}
    assert found["control"] == "within"
    window = {p[0]: p for p in found["points"]["window"]}
    assert window[0.05][1] == pytest.approx((0.5 + 0.5 + 0.6 + 0.5) / 4) and not window[0.05][4]
    assert window[0.25][2] <= window[0.25][1] <= window[0.25][3]
    sampled = kv.verdict(rows_for(KNOWN), "tv", n_boot=500)  # 1 - TV = acceptance in these rows
    assert sampled["lowest"] == found["lowest"]


def test_verdict_control_off_by_more_than_the_margin_reads_outside():
    shifted = {**KNOWN, ("control", 1.0): [0.9, 0.8, 0.9, 0.7]}
    assert kv.verdict(rows_for(shifted), n_boot=500)["control"] == "outside"
    with pytest.raises(ValueError, match="full cache's accept is missing or zero"):
        kv.verdict(rows_for({("full", 1.0): [0.0, 1.0], ("window", 0.5): [0.5, 0.5]}))


def test_curve_on_a_tiny_target_full_cache_is_the_target_and_4_bits_are_lossy(tiny_llama64):
    prompts = [{"id": f"t{i}", "kind": "retrieval", "tokens": [(7 * i + 3 * j) % 60 + 2 for j in range(40)]}
               for i in range(2)]
    rows = kv.curve(tiny_llama64, prompts, ["window", "quant4"], [0.25, 1.0], depth=4, new_tokens=8,
                    mal_prompts=1, log=lambda line: None)
    assert len(rows) == 2 * (2 + 2 * 2)
    by = {(r["prompt"], r["policy"], r["retention"]): r for r in rows}
    for p in ("t0", "t1"):
        full, control = by[p, "full", 1.0], by[p, "control", 1.0]
        assert full["accept"] == 1.0 and full["tv"] < 1e-9 and abs(full["kl"]) < 1e-9
        assert {k: control[k] for k in ("accept", "tv", "kl")} == {k: full[k] for k in ("accept", "tv", "kl")}
        assert by[p, "quant4", 1.0]["tv"] > 1e-6 and by[p, "quant4", 1.0]["memory_fraction"] <= 0.5
        assert by[p, "window", 0.25]["memory_fraction"] < 1.0 and by[p, "window", 1.0]["kv"] == "full"
    assert by["t0", "full", 1.0]["mal"] == pytest.approx(8 / 2)  # chain(4): 5 + 3 tokens in two steps
    assert by["t1", "full", 1.0]["mal"] is None  # MAL on the first prompt only
    assert kv.verdict(rows, n_boot=200)["control"] == "within"


def write_curve(results, rows):
    settings = {"model": "tiny", "prompts": 4, "context": 2048, "new_tokens": 64, "depth": 12, "mal_prompts": 1,
                "seconds": 12.0, "threads": 1}
    (results / kv.CURVE_FILE).write_text(json.dumps({"settings": settings, "rows": rows}))


def test_report_parts_from_a_curve_file(tmp_path):
    assert kv.report_parts(tmp_path, records_root=tmp_path / "none") == ([], [], None)
    write_curve(tmp_path, rows_for(KNOWN))
    md, verdict, summary = kv.report_parts(tmp_path, records_root=tmp_path / "none", n_boot=500)
    assert md[0] == "" and md[1].startswith("## The KV question")
    assert len(verdict) == 1 and "window 25% (sampled, 1 - TV: 25%)" in verdict[0] and "quant4 none" in verdict[0]
    assert verdict[0].endswith("A/A control (full vs full): within")
    assert summary["greedy"] == {"window": 0.25, "snapkv": 1.0, "quant4": None} and summary["control"] == "within"
    assert sum(line.startswith("| window |") for line in md) == 3


def test_report_parts_include_the_latest_recorded_sweep(tmp_path):
    found = kv.verdict(rows_for(KNOWN), n_boot=200)
    for date_rows in ("old", "new"):
        result = {"bench": "self_draft", "retentions": [0.05, 0.25, 1.0], "prompts_per_context": 8,
                  "new_tokens": 64, "depth": 12, "verdicts": {f"2k-{date_rows}": found}}
        records.append("self_draft", result, ["python", "scripts/bench_self_draft.py"], root=tmp_path)
    assert kv.latest_sweep(tmp_path)["result"]["verdicts"].keys() == {"2k-new"}
    md, verdict, summary = kv.report_parts(tmp_path, records_root=tmp_path)
    assert verdict == [] and summary["sweep"]["verdicts"] == {"2k-new": found["lowest"]}
    assert any(line.startswith("| 2k-new | window |") and line.endswith("| 25% |") for line in md)
    assert any(line.startswith("| 2k-new | control |") and line.endswith("| A/A: within |") for line in md)


def test_main_job_runs_the_grids_kv_entry_and_kv_off_skips_it(tmp_path):
    from experiments.main import kv_command

    grid = tmp_path / "g.yaml"
    grid.write_text("blocks: []\nkv:\n  prompts: 3\n  new_tokens: 16\n")
    assert kv_command(grid, "R", [])[2:] == ["experiments.kv", "R", "--prompts", "3", "--new-tokens", "16"]
    assert kv_command(grid, "R", ["kv=off"]) is None
    with pytest.raises(ValueError, match="kv=on: the KV curve takes only kv=off"):
        kv_command(grid, "R", ["kv=on"])
    grid.write_text("blocks: []\n")
    assert kv_command(grid, "R", []) is None


def test_ledger_prompts_fit_the_context_and_carry_the_needle_and_a_small_sweep_reaches_the_report(embedded, tmp_path):
    prompts = kv.long_prompts(embedded, 4, 2048)
    assert [p["kind"] for p in prompts] == ["retrieval", "summary", "retrieval", "summary"]
    assert all(1700 < len(p["tokens"]) <= 2048 for p in prompts)
    assert len({tuple(p["tokens"][:300]) for p in prompts}) == 4  # each starts at its own section
    text = [embedded.tokenizer.decode(p["tokens"]) for p in prompts]
    assert all("harbour master's spare key is kept" in t for t in text)
    assert "Question: where is the harbour master's spare key kept?" in text[0] and "Summarize" in text[1]
    with pytest.raises(ValueError, match="context 200 tokens holds 0 ledger sections"):
        kv.long_prompts(embedded, 1, 200)

    # the full-sweep script at its smallest: its record (SPECDEC_RECORDS, set by conftest) is what the report shows
    bench = importlib.import_module("scripts.bench_self_draft")
    result = bench.main(["--contexts", "400", "--prompts", "2", "--policies", "window", "--retentions", "25,100",
                         "--new-tokens", "4", "--mal-prompts", "1", "--depth", "2", "--bootstrap", "100"])
    assert {(r["prompt"], r["policy"], r["retention"]) for r in result["rows"]} == {
        (f"ledger-400-{i}-{k}", p, r) for i, k in enumerate(("retrieval", "summary"))
        for p, r in (("full", 1.0), ("control", 1.0), ("window", 0.25), ("window", 1.0))}
    assert result["verdicts"]["400"]["control"] == "within"
    md, _, summary = kv.report_parts(tmp_path)
    assert summary["sweep"]["verdicts"] == {"400": result["verdicts"]["400"]["lowest"]}
    assert any(line.startswith("| 400 | window |") for line in md)
