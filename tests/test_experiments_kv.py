"""The KV step (experiments/kv.py): retention -> policy specs, the verdicts and the A/A control on
rows with a known answer, the timed runs on a tiny target (identity with plain decoding, acceptance,
the packed cache's bytes), the report's KV section, the main job's `kv:` command, and the dataset
prompts on the embedded tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

import specdec

from experiments import kv


def test_policy_spec_keeps_the_asked_share_of_the_prompt():
    assert kv.policy_spec("window", 0.05, 2000) == "window(sink=4,recent=96)"
    assert kv.policy_spec("snapkv", 0.25, 2000) == "snapkv(budget=500,window=32)"
    assert kv.policy_spec("quant4", 0.25, 2000) == "window(sink=4,recent=496)+quant(bits=4,keys=token)"
    assert kv.policy_spec("quant2c", 0.1, 2000) == "window(sink=4,recent=196)+quant(bits=2,keys=channel)"
    for wrong in ("quant3", "quant4cc", "quantc"):
        with pytest.raises(ValueError, match="quantNc"):
            kv.policy_spec(wrong, 0.5, 2000)
    with pytest.raises(ValueError, match="at 1 window and snapkv are the full cache"):
        kv.policy_spec("window", 1.0, 2000)
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        kv.policy_spec("lru", 0.5, 2000)


def _rows(acceptance: dict, speedup: dict, aa: float = 1.0) -> list[dict]:
    """Rows of 6 prompts: plain at 100 ms/token (plain2 at 100 * aa, jittered), each (policy, r) at its
    acceptance and at 100 / speedup ms/token, each jittered by +-1%."""
    rows = []
    for i in range(6):
        jitter = 1 + 0.01 * (i % 3 - 1)
        rows += [{"prompt": f"p{i}", "policy": "plain", "retention": None, "seconds_per_token": 0.1,
                  "acceptance": None, "kv": None, "kv_bytes_per_token": None},
                 {"prompt": f"p{i}", "policy": "plain2", "retention": None, "seconds_per_token": 0.1 * aa * jitter,
                  "acceptance": None, "kv": None, "kv_bytes_per_token": None}]
        rows += [{"prompt": f"p{i}", "policy": p, "retention": r, "seconds_per_token": 0.1 / speedup[p, r] * jitter,
                  "acceptance": min(1.0, a * jitter), "kv": f"{p}@{r}", "kv_bytes_per_token": 100.0}
                 for (p, r), a in acceptance.items()]
    return rows


def test_verdicts_read_acceptance_free_from_the_top_and_pays_from_the_speedup_ci():
    acceptance = {("window", 0.5): 0.99, ("window", 0.25): 0.97, ("window", 0.1): 0.7, ("window", 0.05): 0.99}
    speedup = {("window", 0.5): 0.8, ("window", 0.25): 1.2, ("window", 0.1): 0.9, ("window", 0.05): 1.3}
    found = kv.summarize(_rows(acceptance, speedup), n_boot=200)
    assert found["verdicts"] == {"window": {"acceptance_free": 0.25, "pays_in_time": 0.05}}
    assert found["control"]["verdict"] == "within"
    row = next(r for r in found["rows"] if r["retention"] == 0.25)
    assert row["shape"] == kv.SHAPE and row["speedup_ci"][0] > 1 and abs(row["speedup"] - 1.2) < 0.02
    assert kv.summarize(_rows(acceptance, speedup, aa=1.1), n_boot=200)["control"]["verdict"] == "outside"


@pytest.fixture(scope="module")
def world():
    """A tiny fp64 target whose greedy path depends on its KV (as in test_kv_packed)."""
    return specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=1, logit_scale=4.0)


def test_measure_times_every_policy_between_two_plain_runs_and_the_report_reads_it(world, tmp_path):
    items = [{"id": f"t{i}", "kind": "k", "tokens": [(7 * i + j * j) % 60 + 2 for j in range(80)]} for i in range(2)]
    rows = kv.measure(world, items, ["window", "quant4", "quant4c"], [0.1, 0.5], new_tokens=12, log=lambda _: None)
    assert [r["policy"] for r in rows[:8]] == ["plain", "window", "window", "quant4", "quant4", "quant4c", "quant4c",
                                               "plain2"]
    spec = [r for r in rows if r["retention"] is not None]
    assert all(0 <= r["acceptance"] <= 1 and r["seconds_per_token"] > 0 for r in spec)
    assert any(r["acceptance"] < 1 for r in spec), "the lossy caches never missed a token on this model"
    at = {(r["policy"], r["retention"]): r for r in spec if r["prompt"] == "t0"}
    bytes_at = {cell: r["kv_bytes_per_token"] for cell, r in at.items()}
    assert bytes_at["quant4", 0.5] < bytes_at["window", 0.5] / 3  # 4-bit codes and fp16 scales vs fp64 entries
    assert bytes_at["window", 0.1] < bytes_at["window", 0.5] / 3  # the window physically holds fewer entries
    # channel keys keep whole groups of G = head_dim here (< 32): more entries than the window, bytes as held
    assert at["quant4c", 0.1]["kv_entries"] > at["quant4", 0.1]["kv_entries"] == at["window", 0.1]["kv_entries"]
    assert at["quant4c", 0.1]["kv_bytes"] > at["quant4", 0.1]["kv_bytes"]
    settings = {"source": "test", "prompts": 2, "min_tokens": 80, "max_tokens": 80, "new_tokens": 12, "cpu": "cpu",
                "threads": 1, "seconds": 1.0, "physics": kv.physics(world)}
    (tmp_path / kv.CURVE_FILE).write_text(json.dumps({"settings": settings, "rows": rows}))
    md, verdict, summary = kv.report_parts(tmp_path, n_boot=100)
    assert set(summary["verdicts"]) == {"window", "quant4", "quant4c"} and len(summary["rows"]) == 6
    assert set(summary["rows"][0]) == {"policy", "retention", "shape", "acceptance", "acceptance_ci", "speedup",
                                       "speedup_ci"}
    assert verdict[0].startswith("- KV compression") and "A/A timing control" in verdict[0]
    assert sum(line.startswith("| window |") for line in md) == 2
    floors = [line for line in md if line.startswith("| window 10% draft forward |")]
    assert len(floors) == 1 and float(floors[0].split("|")[3]) > 0 and settings["physics"]["bandwidth"] > 1e8
    assert settings["physics"]["weight_bytes"] == sum(p.nbytes for p in world.model.parameters())
    assert sum(line.startswith("**Answer.** Acceptance: window acceptance-free down to") for line in md) == 1
    assert kv.report_parts(tmp_path / "none") == ([], [], None)


def test_the_sweep_times_each_shape_and_keeps_their_verdicts_apart(world, tmp_path):
    items = [{"id": f"t{i}", "kind": "k", "tokens": [(5 * i + j * j) % 60 + 2 for j in range(80)]} for i in range(2)]
    rows = kv.measure(world, items, ["window"], [0.1], new_tokens=8, log=lambda _: None,
                      shapes=("chain(1)", "chain(4)"))  # each run is checked token-identical to plain inside
    assert [(r["policy"], r["shape"]) for r in rows[:4]] == [("plain", None), ("window", "chain(1)"),
                                                             ("window", "chain(4)"), ("plain2", None)]
    summary = kv.summarize(rows, n_boot=50)
    assert set(summary["verdicts"]) == {"window chain(1)", "window chain(4)"}
    assert [r["shape"] for r in summary["rows"]] == ["chain(1)", "chain(4)"]
    assert set(kv.summarize([r for r in rows if r["shape"] != "chain(1)"], n_boot=50)["verdicts"]) == {"window"}


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


def test_the_default_source_holds_eight_prompts_over_2k_tokens_in_two_categories(embedded):
    items = kv.prompts(embedded, kv.SOURCE, 8)
    assert len(items) == 8 and all(len(p["tokens"]) >= 2048 for p in items)
    assert {p["kind"] for p in items} == {"long-retrieval", "long-summary"}
    assert len({tuple(p["tokens"][:300]) for p in items}) == 8
    with pytest.raises(ValueError, match="holds 8 questions, 9 asked"):
        kv.prompts(embedded, kv.SOURCE, 9)
