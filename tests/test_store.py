"""The results store under concurrency and damage.

- Many writers: processes racing to store the same cells leave every cell exactly once, and none
  fails; a tiny grid through Hydra's joblib launcher (2 workers) fills one store with every cell once.
- Damage: a truncated rows.jsonl, a cell.json that is not JSON, a done marker without rows are named
  by `damaged_cells` and skipped by `load_rows` with a DamagedCellWarning (or refused with
  DamagedCellError), never averaged.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.store import DamagedCellError, DamagedCellWarning, ResultsStore, StoreError, load_rows

REPO = Path(__file__).resolve().parent.parent


def _write_all(root: str, worker: int, cells: list[str]) -> None:
    store = ResultsStore(root)
    for cell in cells:
        store.write_cell(cell, {"worker": worker}, [{"cell": cell, "worker": worker, "tokens": 8}])


def test_racing_writers_store_every_cell_once(tmp_path):
    root = str(tmp_path / "results")
    cells = [f"c{i:02d}" for i in range(30)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_all, args=(root, w, cells if w % 2 else cells[::-1])) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    store = ResultsStore(root)
    assert store.cell_ids() == cells
    assert store.damaged_cells() == {}
    rows = load_rows(root)
    assert sorted(rows["cell"]) == cells  # one row per cell: no cell stored twice, none mixed
    for cell in cells:  # each stored copy is one writer's whole copy
        assert store.read_meta(cell)["worker"] == int(rows.loc[rows["cell"] == cell, "worker"].iloc[0])


@pytest.fixture
def damaged(tmp_path):
    root = tmp_path / "results"
    store = ResultsStore(root)
    for cell in ("good", "truncated", "badmeta", "norows", "emptyrows"):
        store.write_cell(cell, {}, [{"cell": cell, "tokens": 8}, {"cell": cell, "tokens": 9}])
    rows = store.cell_dir("truncated") / "rows.jsonl"
    rows.write_text(rows.read_text()[:-7])
    (store.cell_dir("badmeta") / "cell.json").write_text('{"key": ')
    (store.cell_dir("norows") / "rows.jsonl").unlink()
    (store.cell_dir("emptyrows") / "rows.jsonl").write_text("")
    return root


def test_damaged_cells_are_named(damaged):
    found = ResultsStore(damaged).damaged_cells()
    assert set(found) == {"truncated", "badmeta", "norows", "emptyrows"}
    assert "truncated" in found["truncated"] and "not JSON" in found["badmeta"]
    assert "without rows" in found["norows"] and "without rows" in found["emptyrows"]


def test_load_rows_skips_damaged_cells_with_a_named_warning(damaged):
    with pytest.warns(DamagedCellWarning) as caught:
        rows = load_rows(damaged)
    assert sorted(set(rows["cell"])) == ["good"] and len(rows) == 2
    named = " ".join(str(w.message) for w in caught)
    for cell in ("truncated", "badmeta", "norows", "emptyrows"):
        assert f"damaged cell {cell} " in named


def test_load_rows_can_refuse_damage(damaged):
    with pytest.raises(DamagedCellError, match="damaged cell"):
        load_rows(damaged, on_damage="raise")
    assert issubclass(DamagedCellError, StoreError)


def test_joblib_launcher_with_two_workers_fills_one_store(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    results = tmp_path / "results"
    command = [sys.executable, "-m", "experiments.run", "-m", "model=tiny", "dataset=smoke", "runner.warmup_tokens=2",
               "runner.progress=false", f"results.dir={results}", "drafter=ngram,none", "shape=chain4,tree422",
               "max_new_tokens=4", "dataset.question_ids=[smoke-1]",
               "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    store = ResultsStore(results)
    assert len(store.cell_ids()) == 4 and store.damaged_cells() == {}
    rows = load_rows(results)
    assert rows.groupby("cell_id").size().tolist() == [1] * 4
    metas = [store.read_meta(c)["labels"] for c in store.cell_ids()]
    assert {(m["drafter"], m["shape"]) for m in metas} == {(d, s) for d in ("ngram", "none")
                                                          for s in ("chain(4)", "tree(4,2,2)")}
    assert json.loads((results / "STORE.json").read_text())["version"] == 1
