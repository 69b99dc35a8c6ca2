"""The grid beyond one process: a tiny 4-cell grid through Hydra's submitit launcher (its local executor)
and through Hydra's Ray launcher on a local Ray cluster (2 CPUs, on 127.0.0.1, started and stopped here);
every cell lands once in the one results store; a worker killed in the middle of a cell leaves no cell
behind, and the same command run again computes exactly the missing cells. The grids show their progress
bars, as by default: both launchers pickle Hydra's callbacks with every job, the bar's owner among them.

Each launcher's tests skip when its plugin is not installed (pip install 'specdec[submitit]' or
'specdec[ray]'; the Ray launcher pins cloudpickle 2.2.1, which the joblib launcher refuses, so it lives in
an environment of its own, built as experiments/README.md says: run this file with its python)."""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.store import ResultsStore, load_rows

REPO = Path(__file__).resolve().parent.parent
GRID = ["model=tiny", "dataset=smoke", "runner.warmup_tokens=2",
        "runner.latency_widths=[1,2,4,8]", "runner.latency_contexts=[16]", "runner.latency_repeats=1",
        "drafter=ngram,random", "shape=chain4,tree422", "max_new_tokens=48", "dataset.question_ids=[smoke-1,smoke-3]"]
CELLS = 4


def grid_command(results: Path, *launcher: str) -> list[str]:
    return [sys.executable, "-m", "experiments.run", "-m", *GRID, f"results.dir={results}", *launcher]


def snapshot(results: Path) -> dict[str, bytes]:
    return {str(p.relative_to(results)): p.read_bytes() for p in sorted((results / "cells").rglob("*")) if p.is_file()}


def check_full_store(results: Path) -> None:
    """Every cell stored once, whole, with one row per prompt; nothing unfinished in cells/."""
    assert sorted(os.listdir(results / "cells")) == ResultsStore(results).cell_ids()
    rows = load_rows(results, on_damage="raise")
    assert rows.cell_id.nunique() == CELLS and (rows.groupby("cell_id").size() == 2).all()
    assert rows.same_tokens_as_baseline.all()


def start_grid(command: list[str], results: Path, env: dict | None = None) -> subprocess.Popen:
    """The grid in the background, its output in RESULTS/../grid.log (which `kill_mid_cell` quotes)."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results.parent / "grid.log", "w") as log:
        return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def kill_mid_cell(results: Path, workers: callable, proc: subprocess.Popen, timeout: float = 400) -> int:
    """Once a cell is stored, SIGKILL (with its children) a worker that has started a cell and not stored
    it; `workers()` yields (pid, cells started, cells stored) per worker. Returns the pid killed."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (results / "cells").exists() and ResultsStore(results).cell_ids():
            for pid, started, stored in workers():
                if started > stored:
                    victims = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                    for victim in victims:
                        victim.send_signal(signal.SIGKILL)
                    return pid
        time.sleep(0.02)
    ended = "" if proc.poll() is None else f" (the grid exited {proc.returncode} first)"
    raise AssertionError(f"no worker was seen in the middle of a cell after the first cell was stored{ended}:\n"
                         + (results.parent / "grid.log").read_text(errors="replace")[-3000:])


def resume_after_kill(results: Path, command: list[str], env: dict | None = None) -> None:
    """After a kill: no unfinished cell in cells/; the rerun skips every stored cell, rewrites none and
    fills the rest."""
    stored = ResultsStore(results).cell_ids()
    assert 1 <= len(stored) < CELLS, "the killed cell was stored"
    assert all((results / "cells" / c / "done").exists() for c in os.listdir(results / "cells"))
    survivors = snapshot(results)
    earlier = set((results / "hydra").glob("multirun-*"))
    started = time.perf_counter()
    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    print(f"{command[-1]}: rerun after the kill in {time.perf_counter() - started:.1f} s")
    [multirun] = set((results / "hydra").glob("multirun-*")) - earlier
    logs = "".join(f.read_text() for f in multirun.glob("*/run.log"))  # each job's own log, wherever it ran
    assert logs.count("is already stored: skipped") == len(stored) and logs.count("stored ") == CELLS - len(stored)
    assert {k: v for k, v in snapshot(results).items() if k in survivors} == survivors
    check_full_store(results)


def test_the_cell_bar_is_not_pickled_with_the_jobs(tmp_path):
    """Ray and submitit pickle Hydra's callbacks with every job: the bar over cells (a tqdm writing to this
    process's stderr through a wrapper that cannot be unpickled) stays behind, the counts travel."""
    from omegaconf import OmegaConf

    from experiments.run import CellProgress

    progress = CellProgress()
    progress.on_multirun_start(OmegaConf.create({
        "results": {"dir": str(tmp_path)}, "runner": {"progress": True},
        "hydra": {"sweeper": {"params": None}, "overrides": {"task": ["drafter=ngram,random"]}}}))
    shipped = pickle.loads(pickle.dumps(progress))
    assert shipped.bar is None and shipped.total == 2 and progress.bar is not None
    progress.on_multirun_end(None)


# ---- submitit (local executor) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def submitit_installed():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install 'specdec[submitit]'")


def submitit_workers(results: Path):
    """(pid, cells started, cells stored) per submitit job: one cell each; the job's folder is its pid."""
    for job in (results / "hydra").glob("multirun-*/.submitit/*"):
        if job.name.isdigit():
            text = "".join(f.read_text(errors="replace") for f in job.glob("*_log.*"))
            yield int(job.name), int("loading target" in text), text.count("stored /")


def test_submitit_worker_killed_mid_cell_then_rerun(submitit_installed, tmp_path):
    results = tmp_path / "results"
    command = grid_command(results, "hydra/launcher=local")
    proc = start_grid(command, results)
    try:
        kill_mid_cell(results, lambda: submitit_workers(results), proc)
        assert proc.wait(timeout=600) != 0  # the launcher reports the lost job
    finally:
        if proc.poll() is None:
            proc.kill()
    resume_after_kill(results, command)
    assert len(list(submitit_workers(results))) == CELLS + CELLS  # one submitit job per cell, in each run


# ---- Ray (a local cluster on the loopback address) ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray head on 127.0.0.1 with 2 CPUs (2 workers), its own temp dir and its own token (ray 2.60 turns
    token auth on for a head when ~/.ray/auth_token exists, and off for a driver that is not told: say it
    to both, and touch no file in ~); stopped, and its temp dir removed, after the module."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="pip install 'specdec[ray]' (an environment of "
                        "its own: it pins cloudpickle 2.2.1)")
    port = free_port()
    temp = Path(f"/tmp/ray-{os.getpid()}")  # Ray's socket paths must stay short
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    subprocess.run([*ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                   check=True, capture_output=True, timeout=180, env=env)
    try:
        yield f"127.0.0.1:{port}", temp, env
    finally:
        subprocess.run([*ray, "stop", "--force"], capture_output=True, timeout=120, env=env)
        shutil.rmtree(temp, ignore_errors=True)


def ray_workers(temp: Path):
    """(pid, cells started, cells stored) per Ray worker: a worker runs cells one after another; Ray marks
    each task's start in the worker's stderr (':task_name:')."""
    for out in (temp / "session_latest" / "logs").glob("worker-*.out"):
        err = out.with_suffix(".err")
        started = err.read_text(errors="replace").count(":task_name:_run_job") if err.exists() else 0
        yield int(out.stem.rsplit("-", 1)[1]), started, out.read_text(errors="replace").count("stored /")


def test_ray_worker_killed_mid_cell_then_rerun(ray_cluster, tmp_path):
    """Ray may retry the killed task itself (then the grid ends complete); either way no cell is partial and
    the rerun computes exactly what is missing."""
    address, temp, env = ray_cluster
    results = tmp_path / "results"
    command = grid_command(results, "hydra/launcher=ray_cluster", f"hydra.launcher.ray.init.address={address}",
                           "+hydra.launcher.ray.remote.max_retries=0")
    proc = start_grid(command, results, env)
    try:
        kill_mid_cell(results, lambda: ray_workers(temp), proc)
        assert proc.wait(timeout=600) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    resume_after_kill(results, command, env)


def test_no_ray_cluster_at_the_address_is_a_clear_error(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="pip install 'specdec[ray]'")
    from experiments.launchers import LauncherError, check_launcher

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(LauncherError, match=rf"no Ray cluster answers at {address}.*ray start --head"):
        check_launcher(["hydra/launcher=ray_cluster", f"hydra.launcher.ray.init.address={address}"])


def test_a_launcher_whose_plugin_is_missing_names_the_extra(monkeypatch):
    from experiments import launchers

    monkeypatch.setattr(launchers, "_installed", lambda module: False)
    for name, extra in (("local", "submitit"), ("slurm", "submitit"), ("ray_cluster", "ray"),
                        ("joblib", "experiments")):
        with pytest.raises(launchers.LauncherError,
                           match=rf"hydra/launcher={name} needs .*pip install 'specdec\[{extra}\]'"):
            launchers.check_launcher(["drafter=ngram", f"hydra/launcher={name}"])
    launchers.check_launcher(["drafter=ngram"])  # the basic launcher needs nothing
