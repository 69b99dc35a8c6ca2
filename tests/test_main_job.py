"""The main job as a new user meets it: a typo stops it before anything runs or is written; a run (and
a failed one) leaves the checkout's `git status` as it was and the measurement pages up to date; its
record reaches docs/measurements only through `scripts/measurements.py --publish`."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "dataset=smoke", "dataset.question_ids=[smoke-1,smoke-4]", "drafter=random", "shape=chain2",
        "quant=fp32_again", "max_new_tokens=4", "kv=off",
        "prediction=off", "runner.warmup_tokens=2", "runner.progress=false",
        "runner.latency_widths=[1,2,4]", "runner.latency_contexts=[16]", "runner.latency_repeats=1"]


def _measurements():
    return importlib.import_module("scripts.measurements")


def _status() -> str:
    """The checkout's `git status`, untracked files listed one by one."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def _main_job(results: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The job as a user starts it: without the tests' $SPECDEC_RECORDS, it must stay out of the checkout itself."""
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_RECORDS"}
    return subprocess.run([sys.executable, "-m", "experiments.main", *overrides, f"results.dir={results}"], cwd=REPO,
                          capture_output=True, text=True, timeout=500, env=env, check=False)


@pytest.mark.parametrize("typo, says", [("drafter=eagel", "Could not find 'drafter/eagel'"),
                                        ("dataset=mian", "Could not find 'dataset/mian'"),
                                        ("max_new_token=8", "Could not override 'max_new_token'")])
def test_a_typo_stops_the_main_job_before_anything_runs(tmp_path, typo, says):
    before = _status()
    started = time.monotonic()
    proc = _main_job(tmp_path / "r", typo)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "nothing was run or written" in proc.stderr
    assert proc.stdout == ""  # not even the commands: none of them ran
    assert not (tmp_path / "r").exists() and _status() == before
    assert elapsed < 60, f"{elapsed:.0f} s: a typo must fail in the seconds of the imports, not after the grid"


def test_a_main_job_writes_nothing_into_the_checkout_and_publishes_only_when_asked(tmp_path):
    before = _status()
    results = tmp_path / "run"
    proc = _main_job(results, *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Do quantization and speculative decoding compound here?" in proc.stdout
    assert _status() == before, "the main job wrote into the checkout"
    gen = _measurements()
    assert gen.main(["--check"]) == 0, "the checked-in pages no longer match their records"
    (record_file,) = (results / "records").glob("*.jsonl")
    record = json.loads(record_file.read_text())
    assert record["kind"] == "main" and record["result"]["grid_exit"] == 0
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == record["result"]  # the JSON line is the record
    counts = record["result"]["record"]  # this run is the record's only run; its A/A reads either way
    assert counts["runs"] == 1 and counts["control"] == (record["result"]["control"] == "compound")
    assert f"A/A compound in {counts['control']} of 1" in proc.stdout

    # Spec-Bench's answer format, from the same store: per question its turns' text, steps, tokens and
    # times, and every step's acceptance length.
    (answers,) = (results / "leaderboard" / "spec_bench").glob("*.jsonl")  # the main job's leaderboard wrote it
    lines = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [a["question_id"] for a in lines] == ["smoke-1", "smoke-4"]
    for a in lines:
        (choice,) = a["choices"]
        assert set(a) >= {"question_id", "category", "answer_id", "model_id", "choices"}
        assert set(choice) >= {"turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}
        assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"])  # one per step
        assert sum(choice["accept_lengths"]) >= sum(choice["new_tokens"])  # a last step may pass max_new_tokens
        assert all(1 <= n <= 3 for n in choice["accept_lengths"]) and all(isinstance(t, str) for t in choice["turns"])

    # Publishing is explicit, into the records directory it is given, once per record.
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs" / "measurements" / "results", docs / "results")
    assert gen.main(["--publish", str(results), "--results", str(docs / "results"), "--out", str(docs)]) == 0
    published = (docs / "results" / record_file.name).read_text().splitlines()
    assert json.loads(published[-1]) == record
    assert (docs / record_file.with_suffix(".md").name).is_file()
    assert gen.main(["--publish", str(results), "--results", str(docs / "results"), "--out", str(docs)]) == 0
    assert (docs / "results" / record_file.name).read_text().splitlines() == published  # not twice
    assert gen.main(["--check", "--results", str(docs / "results"), "--out", str(docs)]) == 0

    # A grid that fails (eagle has no head for the tiny model) prints no verdict, least of all the
    # earlier run's, and rewrites no report, board or record.
    report = (results / "REPORT.md").read_bytes()
    failed = _main_job(results, *[o.replace("drafter=random", "drafter=eagle") for o in TINY])
    assert failed.returncode != 0
    assert "Do quantization" not in failed.stdout and "no report and no record were written" in failed.stderr
    assert (results / "REPORT.md").read_bytes() == report
    assert record_file.read_text().count("\n") == 1
    assert _status() == before


def test_spec_bench_question_files_are_a_dataset(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.config import CONF_DIR, register_configs
    from experiments.questions import PromptSuiteError, load_questions

    questions = tmp_path / "question.jsonl"  # Spec-Bench's format, as its data/spec_bench/question.jsonl
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Again."]})
                         + "\n" + json.dumps({"question_id": 3, "category": "rag", "turns": ["Who?"]}) + "\n")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["dataset=specbench", f"dataset.source={questions}"])
        missing = compose("config", overrides=["dataset=specbench"])
    got = load_questions(OmegaConf.to_object(cfg).dataset)
    assert [(q.question_id, q.category, len(q.turns)) for q in got] == [("81", "writing", 2), ("3", "rag", 1)]
    with pytest.raises(PromptSuiteError, match="PATH/TO/spec_bench/question.jsonl"):  # the user names the file
        load_questions(OmegaConf.to_object(missing).dataset)


def test_the_record_counts_every_stored_run_of_the_grid_once(tmp_path):
    """Two stored runs (one also published: counted once), a run of another grid, and this run."""
    from experiments.main import record_counts
    from specdec.measure.records import make_record

    def record(kind: str, date: str, fight: bool, control: str, met: bool) -> str:
        predicted = [{"cell": "eagle", "within": met, "at_equal_acceptance": [1, 1, 1],  # the twin is not counted
                      "within_at_equal_acceptance": fight}, {"cell": "A/A twin", "within": False}]
        return json.dumps(make_record(kind, {"verdict": {"eagle": "fight" if fight else "inconclusive"},
                                             "control": control, "cost_model": {"beats_nulls": met},
                                             "prediction": predicted, "mechanism_control": {"within": fight}})
                          | {"date": date})

    own, published = tmp_path / "own.jsonl", tmp_path / "published.jsonl"
    own.write_text(record("main", "d1", True, "compound", True) + "\n" + record("main", "d2", False, "fight", False) + "\n")
    published.write_text(record("main", "d1", True, "compound", True) + "\n"
                         + record("main-full", "d3", True, "compound", True) + "\n")
    this_run = {"verdict": {"eagle": "fight"}, "control": "compound", "cost_model": {"beats_nulls": False}}
    assert record_counts("main", [own, published, tmp_path / "absent.jsonl"], this_run) == {
        "runs": 3, "fight": 2, "control": 2, "cost": 1, "predicting": 2, "predicted": 1, "equalled": 2,
        "equal": 1, "controlled": 2, "mechanism": 1}
