"""The main job as a new user meets it: a typo stops it before anything runs or is written; a run (and
a failed one) leaves the checkout's `git status` as it was and the measurement pages up to date; its
record reaches docs/measurements only through `scripts/measurements.py publish`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "dataset=smoke", "dataset.question_ids=[smoke-1,smoke-4]", "drafter=random", "shape=chain2",
        "quant=fp32_again", "max_new_tokens=4", "kv=off", "runner.warmup_tokens=2", "runner.progress=false",
        "runner.latency_widths=[1,2,4]", "runner.latency_contexts=[16]", "runner.latency_repeats=1"]


def _measurements():
    spec = importlib.util.spec_from_file_location("measurements", REPO / "scripts" / "measurements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _status() -> str:
    """The checkout's `git status`, untracked files listed one by one."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


def _main_job(results: Path, *overrides: str) -> subprocess.CompletedProcess:
    env_free = {"SPECDEC_RECORDS"}  # the job must not need the tests' redirection of records to stay out
    import os

    env = {k: v for k, v in os.environ.items() if k not in env_free}
    return subprocess.run([sys.executable, "-m", "experiments.main", *overrides, f"results.dir={results}"], cwd=REPO,
                          capture_output=True, text=True, timeout=500, env=env)


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

    # Publishing is explicit, into the records directory it is given, once per record.
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs" / "measurements" / "results", docs / "results")
    assert gen.main(["publish", str(results), "--results", str(docs / "results"), "--out", str(docs)]) == 0
    published = (docs / "results" / record_file.name).read_text().splitlines()
    assert json.loads(published[-1]) == record
    assert (docs / record_file.with_suffix(".md").name).is_file()
    assert gen.main(["publish", str(results), "--results", str(docs / "results"), "--out", str(docs)]) == 0
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
