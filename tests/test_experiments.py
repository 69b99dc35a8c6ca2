"""The experiment runner end to end on a tiny model: a Hydra grid, the store, resume, SIGKILL, bad input,
the main job's blocks and its pasteable dry run.

Grids run as `python -m experiments.run -m ...` subprocesses (Hydra's basic launcher, as a user runs
them) on `model=tiny` with the `smoke` prompts; bad-input checks compose configs in-process.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

import specdec

from experiments.config import CONF_DIR, DatasetConfig
from experiments.leaderboard import main as leaderboard_cli
from experiments.main import grid_blocks
from experiments.questions import PromptSuiteError, load_questions
from experiments.run import run_experiment
from experiments.store import MANIFEST, ResultsStore, StoreError, load_rows

REPO = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "dataset=smoke", "runner.warmup_tokens=2", "runner.progress=false",
        "runner.latency_widths=[1,2,4,8]", "runner.latency_contexts=[16]", "runner.latency_repeats=1"]


def run_grid(results: Path, *overrides: str, extra_conf: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "experiments.run", "-m", *TINY, f"results.dir={results}", *overrides]
    if extra_conf is not None:
        command.append(f"hydra.searchpath=[file://{extra_conf}]")
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400)


def snapshot(results: Path) -> dict[str, bytes]:
    return {str(p.relative_to(results)): p.read_bytes() for p in sorted((results / "cells").rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def extra_conf(tmp_path_factory) -> Path:
    """An extra config dir with a quant preset the tiny model supports (width 32 needs group 32)."""
    conf = tmp_path_factory.mktemp("conf")
    (conf / "quant").mkdir()
    (conf / "quant" / "q4g32.yaml").write_text("spec: rtn4_g32\n")
    return conf


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory, extra_conf):
    """A 2 x 2 x 2 grid (drafter x shape x quant: fp32 and a packed kernel) on the tiny model,
    2 prompts, 8 new tokens."""
    results = tmp_path_factory.mktemp("grid") / "results"
    args = ("drafter=ngram,small", "shape=chain4,tree422", "quant=none,torchao_int4", "max_new_tokens=8",
            "dataset.question_ids=[smoke-1,smoke-4]")
    first = run_grid(results, *args, extra_conf=extra_conf)
    assert first.returncode == 0, first.stderr[-3000:]
    return results, args, first


def test_grid_fills_the_store(tiny_grid):
    results, _, first = tiny_grid
    cells = sorted((results / "cells").iterdir())
    assert len(cells) == 8 and all((c / "done").exists() for c in cells)
    rows = load_rows(results)
    assert len(rows) == 8 * 2
    assert set(rows.drafter) == {"ngram", "small"} and set(rows.quant) == {"none", "torchao_int4_g32"}
    labels = rows.drop_duplicates("quant").set_index("quant")
    assert labels.bits.to_dict() == {"none": 32.0, "torchao_int4_g32": 4.0}
    # Three speedups per row; on the unquantized target the reference is the plain run itself.
    none = rows[rows.quant == "none"]
    assert (none.speedup_quant == 1.0).all() and (none.speedup_compound == none.speedup).all()
    quantized = rows[rows.quant != "none"]
    assert (quantized.reference_wall_time_s != quantized.baseline_wall_time_s).all()
    # Paired 2x2: every prompt of a kernel cell also ran fp32 drafted; the interaction is the per-prompt
    # ratio of the two speculation speedups. On fp32 itself the two drafted runs are one.
    assert rows.paired.all() and (quantized.reference_drafted_wall_time_s != quantized.wall_time_s).all()
    assert ((rows.interaction - rows.speedup / rows.speedup_reference).abs() < 1e-9).all()
    assert (none.interaction == 1.0).all() and (none.reference_drafted_wall_time_s == none.wall_time_s).all()
    assert (quantized.reference_mal > 1).any() and set(quantized["order"].str.count(",")) == {3}
    # Teacher-forced acceptance on fp32's own text is the free-running acceptance there.
    assert ((none.tf_mal - none.mal).abs() < 1e-9).all() and quantized.tf_mal.notna().all()
    # A chain(4) cell also replays its profile in chain(1..4) and stores each position's accepted depth;
    # on fp32's own text the chain(4) replay is the real run, step for step. Trees store neither.
    chains, trees = rows[rows["shape"] == "chain(4)"], rows[rows["shape"] != "chain(4)"]
    assert chains.tf_chain_steps.map(len).eq(4).all() and chains.tf_chain_accepted.map(len).eq(4).all()
    assert chains.tf_accepted_depth.map(lambda d: len(d) == 8 and max(d) <= 4).all()
    fp32_chains = chains[chains.quant == "none"]
    assert (fp32_chains.tf_chain_steps.map(lambda s: s[3]) == fp32_chains.steps).all()
    assert (fp32_chains.tf_chain_accepted.map(lambda a: a[3]) == fp32_chains.accepted_tokens).all()
    assert trees.tf_chain_steps.isna().all() and trees.draft_probe_s.isna().all()
    # The drafting probe: one median drafting time per depth (1 and 4), the same in every row of a cell.
    small = chains[chains.drafter == "small"]
    assert small.draft_probe_s.map(lambda p: set(p) == {"1", "4"} and min(p.values()) > 0).all()
    assert small.groupby("cell_id").draft_probe_s.apply(lambda p: len({str(x) for x in p}) == 1).all()
    # A kernel cell also probes the fp32 drafter, interleaved with its own (the held-out kernel's ratio).
    assert small[small.quant != "none"].reference_draft_probe_s.map(lambda p: set(p) == {"1", "4"}).all()
    assert small[small.quant == "none"].reference_draft_probe_s.isna().all()
    assert ((quantized.speedup * quantized.speedup_quant / quantized.speedup_compound - 1).abs() < 1e-9).all()
    # Each cell prints its numbers when it ends.
    summaries = [line for line in first.stdout.splitlines() if line.startswith("cell ")]
    assert len(summaries) == 8 and all("MAL" in s and "speculation" in s and "compound" in s for s in summaries)
    assert set(rows["shape"]) == {"chain(4)", "tree(4,2,2)"}
    assert (rows.groupby("cell_id").question_id.nunique() == 2).all()
    # T = 0: speculative decoding is exact, so every drafted run equals its plain-loop run.
    assert rows.same_tokens_as_baseline.all()
    assert ((rows.mal - rows.mean_accepted_tokens - 1).abs() < 1e-9).all()
    assert (rows.speedup > 0).all() and (rows.baseline_tokens_per_s > 0).all()
    meta = json.loads((cells[0] / "cell.json").read_text())
    assert meta["config"]["model"]["name"] == "tiny-llama"
    assert {"git", "hardware", "versions", "key", "overrides", "latency", "model_sizes"} <= set(meta)
    full = specdec.parse_shape(meta["config"]["shape"]["spec"]).max_nodes + 1  # the shape's full verification
    assert meta["latency"]["target"]["widths"] == sorted({1, 2, 4, 8, full})
    assert meta["versions"]["torch"] and meta["hardware"]["cpu_count"]


def test_rerun_does_no_work(tiny_grid, extra_conf):
    results, args, _ = tiny_grid
    before = snapshot(results)
    again = run_grid(results, *args, extra_conf=extra_conf)
    assert again.returncode == 0, again.stderr[-3000:]
    log = again.stdout + again.stderr
    assert log.count("is already stored: skipped") == 8
    assert "loading target" not in log
    assert snapshot(results) == before


def test_leaderboard_of_the_grid(tiny_grid, tmp_path, capsys):
    results, _, _ = tiny_grid
    assert leaderboard_cli([str(results), "--out", str(tmp_path), "--bootstrap", "200"]) == 0
    stdout = capsys.readouterr().out
    assert "## T=0 seed=0 | tiny-llama | dataset smoke (prompts " in stdout and " | 8 new tokens" in stdout
    assert "### Ranked by MAL" in stdout and "### Ranked by end-to-end speed over fp32 plain (compound)" in stdout
    assert (tmp_path / "leaderboard.md").read_text().strip() == stdout.strip()
    import pandas as pd

    table = pd.read_csv(tmp_path / "leaderboard.csv")
    overall = table[table.category == "overall"]
    assert len(overall) == 8 and sorted(overall.rank_mal.unique())[0] == 1
    assert {"chat", "retrieval"} <= set(table.category)
    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name.split("_")[0] for p in pngs] == ["acceptance", "heatmap"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_sigkill_mid_grid_then_rerun_stores_every_cell_once(tmp_path):
    results = tmp_path / "results"
    args = [sys.executable, "-m", "experiments.run", "-m", *TINY, f"results.dir={results}",
            "drafter=ngram,random", "shape=chain4,tree422", "max_new_tokens=16",
            "dataset.question_ids=[smoke-1,smoke-3]"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while not list((results / "cells").glob("*/done")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the grid ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    survivors = snapshot(results)
    stored = ResultsStore(results).cell_ids()
    assert 1 <= len(stored) < 4
    assert all((results / "cells" / c / "done").exists() for c in os.listdir(results / "cells"))

    rerun = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (rerun.stdout + rerun.stderr).count("is already stored: skipped") == len(stored)
    after = snapshot(results)
    assert {k: v for k, v in after.items() if k in survivors} == survivors  # nothing rewritten
    rows = load_rows(results)
    assert rows.cell_id.nunique() == 4 and len(os.listdir(results / "cells")) == 4
    assert (rows.groupby("cell_id").size() == 2).all()  # every (cell, prompt) exactly once


# ---- bad input ------------------------------------------------------------------------------------


@pytest.fixture
def composer():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))


def test_unknown_group_option(composer):
    with pytest.raises(MissingConfigException, match=r"drafter/eaglee"):
        composer("drafter=eaglee")


@pytest.mark.parametrize("override", ["sampling.temprature=0.5", "drafter.nmae=x", "quant.bitz=4", "runner.warmup=1"])
def test_misspelled_key(composer, override):
    key = override.split("=")[0]
    with pytest.raises(ConfigCompositionException, match=rf"Could not override '{key}'") as err:
        composer(override)
    assert f"Key '{key.split('.')[-1]}' not in" in str(err.value.__cause__)
    # Hydra lets `+key=value` append even to a structured node: the runner refuses it before any work.
    with pytest.raises(KeyError, match=rf"unknown config key\(s\) \['{key}'\]"):
        run_experiment(composer("+" + override))


def test_correct_keys_compose(composer):
    cfg = composer("sampling.temperature=0.5", "drafter.name=x", "quant.spec=rtn4_g32", "runner.warmup_tokens=1",
                   "max_new_tokens=7")
    assert (cfg.sampling.temperature, cfg.drafter.name, cfg.quant.spec, cfg.runner.warmup_tokens,
            cfg.max_new_tokens) == (0.5, "x", "rtn4_g32", 1, 7)


def test_sampling_is_the_librarys_config(composer):
    from omegaconf import OmegaConf

    import specdec

    cfg = composer("sampling=sample", "sampling.top_k=5")
    assert OmegaConf.to_object(cfg).sampling == specdec.SamplingConfig(temperature=0.7, top_k=5, top_p=0.95, seed=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        OmegaConf.to_object(composer("sampling.temperature=-1"))


def test_wrong_value_type(composer):
    with pytest.raises(ConfigCompositionException, match="max_new_tokens"):
        composer("max_new_tokens=many")


def test_unregistered_drafter_preset_fails_before_work(composer, tmp_path):
    cfg = composer("model=tiny", "drafter.name=not_a_drafter", f"results.dir={tmp_path / 'r'}")
    with pytest.raises(KeyError, match="not registered; registered drafters: .*ngram"):
        run_experiment(cfg)


def test_every_registered_drafter_is_selectable_and_the_main_grid_picks_new_ones_up(composer, tmp_path):
    from specdec import drafters
    from specdec.drafters.registry import _REGISTRY, register

    from experiments.config import register_configs

    for name in drafters.names():
        assert composer(f"drafter={name}").drafter.name == name
    grid = tmp_path / "grid.yaml"
    grid.write_text("exclude_drafters: [none, random]\n"
                    "blocks:\n"
                    "  - {drafter: [ngram, not_yet_registered], shape: [chain4], quant: [none, gptqref4, bf16]}\n"
                    "  - {drafter: [others], shape: [chain4, dynamic8], quant: [none]}\n"
                    "fixed: [model=tiny, max_new_tokens=8]\n")
    register("grid_test_drafter")(lambda target, **options: None)  # registered, no YAML preset
    try:
        register_configs()
        assert composer("drafter=grid_test_drafter").drafter.name == "grid_test_drafter"
        blocks, notes = grid_blocks(["max_new_tokens=4"], grid)
    finally:
        del _REGISTRY["grid_test_drafter"]
    first, second = (dict(o.split("=", 1) for o in block) for block in blocks)
    assert first["drafter"] == "ngram" and second["shape"] == "chain4,dynamic8"
    others = second["drafter"].split(",")
    assert "grid_test_drafter" in others and not {"ngram", "none", "random"} & set(others)
    assert first["max_new_tokens"] == "4" and first["model"] == "tiny"
    assert any("not_yet_registered" in n for n in notes)
    import specdec.quant

    if "gptqref" not in specdec.quant.names():  # until the reference GPTQ backend is merged
        assert first["quant"] == "none,bf16" and any("gptqref4" in n for n in notes)


def test_bits_label_and_numerics_only_come_from_the_quant_registry():
    import specdec

    from experiments.run import quant_labels

    tiny = specdec.load_target("tiny-llama")
    assert quant_labels("none", tiny) == {"quant": "none", "bits": 32.0, "numerics_only": False, "control": False}
    assert quant_labels("rtn4", tiny) == {"quant": "rtn4_g64", "bits": 4.0, "numerics_only": True, "control": False}
    assert quant_labels("torchao_int4", tiny) == {"quant": "torchao_int4_g32", "bits": 4.0, "numerics_only": False,
                                                  "control": False}
    assert quant_labels("bf16", tiny)["bits"] == 16.0
    for preset in (CONF_DIR / "quant").glob("*.yaml"):  # presets hold a spec (and an A/A label): nothing hand-kept
        assert set(yaml_keys(preset)) <= {"spec", "label"} and "spec" in yaml_keys(preset), preset
    assert quant_labels("none", tiny, "fp32_again") == {"quant": "fp32_again", "bits": 32.0, "numerics_only": False,
                                                       "control": True}


def yaml_keys(path: Path) -> list[str]:
    from omegaconf import OmegaConf

    return list(OmegaConf.load(path).keys())


def test_the_aa_control_is_a_paired_cell_of_its_own(tmp_path, tiny_grid, extra_conf):
    """quant=fp32_again: the fp32 target under another label, paired against fp32 like a kernel."""
    results = tmp_path / "aa"
    done = run_grid(results, "drafter=ngram", "shape=chain4", "quant=fp32_again,none", "max_new_tokens=8",
                    "dataset.question_ids=[smoke-1,smoke-4]")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = load_rows(results)
    aa, none = rows[rows.quant == "fp32_again"], rows[rows.quant == "none"]
    assert rows.cell_id.nunique() == 2 and aa.control.all() and not none.control.any()
    assert (aa.reference_drafted_wall_time_s != aa.wall_time_s).all()  # four runs, not two
    assert aa.same_tokens_as_reference.all() and (aa.mal.to_numpy() == none.mal.to_numpy()).all()


def test_a_drafter_switched_into_a_variant_is_a_cell_and_a_row_of_its_own(tmp_path, extra_conf):
    """`+drafter.options.head_quant=true`: the cell `eagle[head_quant]`, beside plain `eagle` on the same kernel."""
    results = tmp_path / "hq"
    done = run_grid(results, "drafter=eagle", "+drafter.options.head=random", "+drafter.options.head_quant=true,false",
                    "shape=chain2", "quant=q4g32", "max_new_tokens=6", "dataset.question_ids=[smoke-1,smoke-4]",
                    extra_conf=extra_conf)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = load_rows(results)
    assert set(rows.drafter) == {"eagle", "eagle[head_quant]"} and rows.cell_id.nunique() == 2
    assert rows[rows.drafter == "eagle[head_quant]"].cell_id.str.contains("__eagleheadquant__").all()


def test_main_sizes(capsys):
    from experiments.main import GRID_DIR, check_cells, main as main_job

    assert main_job(["--dry-run", "size=full"]) == 0
    full = capsys.readouterr().out
    assert "results.dir=results/full" in full and "quant=fp32_again,bf16,torchao_int4,rtn4,gptqref4" in full
    head_quant = [b for b in grid_blocks([], GRID_DIR / "full.yaml")[0] if "+drafter.options.head_quant=True" in b]
    assert len(head_quant) == 1 and "quant=torchao_int4" in head_quant[0] and len(check_cells(head_quant)) == 1
    assert main_job(["--dry-run", "size=nope"]) == 2
    assert "size=nope: no grid nope.yaml (sizes: batch, full, main)" in capsys.readouterr().err
    assert main_job(["--dry-run", "size=batch"]) == 0
    batch = capsys.readouterr().out
    assert "batch=1,4" in batch and "dataset=batch" in batch and "experiments.kv" not in batch
    assert main_job(["--dry-run"]) == 0
    assert "quant=torchao_int4,fp32_again" in capsys.readouterr().out


def test_main_dry_run_prints_commands_that_paste_as_they_are(capsys):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.main import main as main_job

    assert main_job(["--dry-run"]) == 0
    tune, profile, *lines, kv = capsys.readouterr().out.strip().splitlines()
    assert shlex.split(tune) == [sys.executable, "-m", "specdec.tune", "smollm2-135m", "--reuse", "--threads", "1",
                                 "--quant", "torchao_int4_g32"]  # the grid's real kernel; fp32_again is the reference
    assert shlex.split(kv)[:4] == [sys.executable, "-m", "experiments.kv", "results/main"]  # the grid's `kv:`
    assert "results.dir=results/main/profile" in profile and "dataset.source=chat_heldout" in profile  # held out
    assert lines
    for line in [profile, *lines]:
        words = shlex.split(line)
        assert words[:4] == [sys.executable, "-m", "experiments.run", "-m"]
        OverridesParser.create().parse_overrides(words[4:])  # every override is valid Hydra syntax
        assert line == profile or "results.dir=results/main" in words and "dataset=main" in words


def test_empty_prompt_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(PromptSuiteError, match=r"empty.jsonl: the prompt file has no questions"):
        load_questions(DatasetConfig(source=str(empty)))


def test_malformed_jsonl_line_names_file_and_line(tmp_path, composer):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"question_id": 1, "category": "chat", "turns": ["hi"]})
    bad.write_text(f"{good}\n{good}\n{{\"question_id\": 3, \"turns\": [\n")
    with pytest.raises(PromptSuiteError, match=rf"{bad}:3: not valid JSON"):
        load_questions(DatasetConfig(source=str(bad)))
    bad.write_text(f"{good}\n{json.dumps({'question_id': 2, 'category': 'chat'})}\n")
    with pytest.raises(PromptSuiteError, match=rf"{bad}:2: missing key\(s\) \['turns'\]"):
        load_questions(DatasetConfig(source=str(bad)))
    cfg = composer("model=tiny", f"dataset.source={bad}", f"results.dir={tmp_path / 'r'}")
    with pytest.raises(PromptSuiteError, match=rf"{bad}:2"):
        run_experiment(cfg)


def test_prompt_sources():
    default = load_questions(DatasetConfig(source="default"))
    assert {q.category for q in default} == {"chat", "code", "math", "summarization", "translation",
                                              "extraction", "retrieval"}
    assert any(len(q.turns) > 1 for q in default)
    picked = load_questions(DatasetConfig(source="default", per_category=1, max_turns=1))
    assert len(picked) == 7 and all(len(q.turns) == 1 for q in picked)
    with pytest.raises(PromptSuiteError, match="neither a suite"):
        load_questions(DatasetConfig(source="no_such_suite"))
    with pytest.raises(PromptSuiteError, match="datasets|hub"):
        load_questions(DatasetConfig(source="hf:some-org/some-bench"))


def test_incompatible_store_is_refused_untouched(composer, tmp_path):
    results = tmp_path / "old"
    (results / "cells" / "some_cell").mkdir(parents=True)
    (results / MANIFEST).write_text(json.dumps({"format": "specdec-results", "version": 99}))
    (results / "cells" / "some_cell" / "rows.jsonl").write_text('{"x": 1}\n')
    before = {p: p.read_bytes() for p in results.rglob("*") if p.is_file()}
    cfg = composer("model=tiny", "dataset=smoke", f"results.dir={results}")
    with pytest.raises(StoreError, match="version 99.*version 1"):
        run_experiment(cfg)
    with pytest.raises(StoreError, match="version 99"):
        load_rows(results)
    assert {p: p.read_bytes() for p in results.rglob("*") if p.is_file()} == before
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a specdec results store"):
        ResultsStore(stranger)
    assert sorted(os.listdir(stranger)) == ["notes.txt"]


def test_paired_run_orders_balance_position_and_carry_over():
    """Over four prompts every run takes every position once and follows every other run once, and the
    seams between prompts are balanced between the kernel and the reference, so a carry-over from one
    run to the next cannot bias the interaction (a plain rotation always ran the
    kernel's plain right after its drafted run, and the fp32 drafted right after the fp32 plain)."""
    from collections import Counter

    from experiments.cell import RUNS, run_order

    orders = [run_order(RUNS, k) for k in range(4)]
    assert all(sorted(o) == sorted(RUNS) for o in orders)
    assert Counter((run, i) for o in orders for i, run in enumerate(o)) == Counter(
        {(run, i): 1 for run in RUNS for i in range(4)})
    follows = Counter(pair for o in orders for pair in zip(o, o[1:]))
    assert sorted(follows) == sorted((a, b) for a in RUNS for b in RUNS if a != b) and set(follows.values()) == {1}
    # The prompts run back to back: across the seams too (cyclic, the warm-up being row -1), swapping the
    # kernel's runs with the reference's leaves every (run, position, predecessor) count unchanged, so
    # an A/A control's interaction has no carry-over bias. The previous square failed this.
    swap = {"drafted": "reference_drafted", "reference_drafted": "drafted", "plain": "reference", "reference": "plain"}

    def seen(rows):
        return Counter((run, i, o[i - 1] if i else rows[k - 1][-1]) for k, o in enumerate(rows) for i, run in enumerate(o))

    assert run_order(RUNS, -1) == orders[-1]
    assert seen(orders) == Counter({(swap[r], i, swap[b]): n for (r, i, b), n in seen(orders).items()})
    old = [[RUNS[i] for i in row] for row in ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))]
    assert seen(old) != Counter({(swap[r], i, swap[b]): n for (r, i, b), n in seen(old).items()})
    assert run_order(RUNS[:2], 0) == ["drafted", "plain"] and run_order(RUNS[:2], 1) == ["plain", "drafted"]


def test_a_cells_latency_curve_includes_its_shapes_full_verification_width():
    """The cost model prices most verifications at the shape's full width; the curve measures that
    width itself instead of interpolating across a kernel's step between grid points."""
    from types import SimpleNamespace

    from experiments.run import curve_widths

    def widths(spec):
        return curve_widths(SimpleNamespace(shape=SimpleNamespace(spec=spec),
                                            runner=SimpleNamespace(latency_widths=[1, 2, 4, 8])))

    assert widths("chain(4)") == (1, 2, 4, 5, 8) and widths("chain(3)") == (1, 2, 4, 8)
    assert widths("tree(2,2)") == (1, 2, 4, 7, 8) and widths("dynamic(top_k=4,depth=3,budget=12)") == (1, 2, 4, 8, 13)
    assert widths("auto") == (1, 2, 4, 8)


def test_a_cells_latency_curves_are_timed_in_passes_between_its_units(tiny_llama64):
    """ceil(R / U) passes after each of a cell's U units (a prompt's runs; a batch's group), every timer
    alike: every unit's first run follows the same pause, and the curve sees the machine the runs saw. A
    reference that is the target's own object is timed once; a batch cell times every row count, with holes."""
    from types import SimpleNamespace

    from experiments.run import CellCurves
    from specdec.core.curve import LatencyCurve

    runner = SimpleNamespace(latency_widths=[1, 2], latency_contexts=[4, 8], latency_repeats=3)
    cfg = SimpleNamespace(batch=1, shape=SimpleNamespace(spec="chain(2)"), runner=runner)
    curves = CellCurves(cfg, {"target": tiny_llama64, "reference": tiny_llama64}, units=7)
    assert len(curves.timers) == 1 and curves.timers[0].passes == 0
    passes = []
    for _ in range(7):
        curves.after_unit()
        passes.append(curves.timers[0].passes)
    assert passes == [1, 2, 3, 4, 5, 6, 7]  # R = 3 < 7 units: one pass after every unit
    out = curves.to_json()
    assert set(out) == {"target", "reference"} and out["target"] == out["reference"]
    curve = LatencyCurve.from_json(out["target"])
    assert curve.widths == (1, 2, 3) and curve.contexts == (4, 8) and curve.batch == 1 and not curve.holes

    cfg.batch = 3
    curves = CellCurves(cfg, {"target": tiny_llama64}, units=2)
    assert len(curves.timers) == 3
    curves.after_unit()
    assert [t.passes for t in curves.timers] == [2, 2, 2]  # ceil(3 / 2) after each unit
    curves.after_unit()
    out = curves.to_json()
    assert set(out) == {"target", "target_rows"} and set(out["target_rows"]) == {"1", "2"}
    rows = {r: LatencyCurve.from_json(c) for r, c in {"3": out["target"], **out["target_rows"]}.items()}
    assert all(c.batch == int(r) and c.holes for r, c in rows.items())
