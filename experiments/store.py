"""The results store: one directory per finished cell, written atomically, readable with pandas.

Layout of a store RESULTS/ (version 1):

    RESULTS/STORE.json                 {"format": "specdec-results", "version": 1}, written once
    RESULTS/cells/<cell_id>/cell.json  the cell: key, resolved config, git commit, hardware, versions
    RESULTS/cells/<cell_id>/rows.jsonl one JSON object per (question, turn): tokens, MAL, timings, ...
    RESULTS/cells/<cell_id>/done       written last: a cell directory without it is not finished
    RESULTS/.partial/                  cells being written (or left behind by a killed run)
    RESULTS/hydra/                     Hydra's own logs, never read by the store

A cell is written in full under .partial/, every file fsynced, `done` last, then renamed into
cells/ in one `rename` (atomic on POSIX filesystems) and the directory entry fsynced. A run killed
at any point leaves finished cells intact and at most a stray folder in .partial/, which readers
ignore. Nothing in cells/ is ever overwritten or deleted by the store. Owns none of the measuring:
rows arrive as plain dicts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

FORMAT = "specdec-results"
VERSION = 1
MANIFEST = "STORE.json"
DONE = "done"
# Entries a fresh store directory may already hold (Hydra creates its log folder before a job runs).
_FOREIGN_OK = {"hydra"}


class StoreError(RuntimeError):
    """A results directory that this version of the store cannot use."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class ResultsStore:
    """A results directory, opened (created when absent or holding only Hydra logs) and checked."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().resolve()
        self.cells_dir = self.root / "cells"
        self.partial_dir = self.root / ".partial"
        manifest = self.root / MANIFEST
        if manifest.exists():
            self._check_manifest(manifest)
        else:
            self._create(manifest)

    def _check_manifest(self, manifest: Path) -> None:
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise StoreError(f"{manifest} is unreadable ({err}); this is not a specdec results store "
                             "this version can use. Nothing was changed; pick another results.dir") from err
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StoreError(f"{self.root} is not a specdec results store ({manifest} says {data!r:.120}). "
                             "Nothing was changed; pick another results.dir")
        if data.get("version") != VERSION:
            raise StoreError(
                f"{self.root} was written by results-store version {data.get('version')!r}; this specdec reads "
                f"and writes version {VERSION}. Nothing was read or changed. Use a new results.dir, or the "
                "specdec version that wrote it to read it"
            )

    def _create(self, manifest: Path) -> None:
        if self.root.exists():
            if not self.root.is_dir():
                raise StoreError(f"results.dir {self.root} exists and is not a directory")
            foreign = sorted(p.name for p in self.root.iterdir() if p.name not in _FOREIGN_OK)
            if foreign:
                raise StoreError(
                    f"{self.root} is not empty and has no {MANIFEST}, so it is not a specdec results store "
                    f"(found {foreign[:5]}). Nothing was changed; pick an empty or new results.dir"
                )
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{MANIFEST}.{socket.gethostname()}.{os.getpid()}"
        _write_synced(tmp, json.dumps({"format": FORMAT, "version": VERSION}) + "\n")
        try:
            os.link(tmp, manifest)  # fails if another process created the store first: no overwrite
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        _fsync_dir(self.root)
        self._check_manifest(manifest)

    # ---- cells -------------------------------------------------------------------------------------
    def cell_dir(self, cell_id: str) -> Path:
        return self.cells_dir / cell_id

    def has(self, cell_id: str) -> bool:
        """True when the cell is finished (its `done` marker exists)."""
        return (self.cell_dir(cell_id) / DONE).exists()

    def cell_ids(self) -> list[str]:
        """Finished cells, sorted."""
        if not self.cells_dir.exists():
            return []
        return sorted(p.name for p in self.cells_dir.iterdir() if (p / DONE).exists())

    def write_cell(self, cell_id: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
        """Store a finished cell atomically; returns its directory. If the cell was finished meanwhile
        (a parallel launcher), the stored copy is kept and this one dropped."""
        if not rows:
            raise ValueError(f"cell {cell_id} has no rows to store")
        self.cells_dir.mkdir(exist_ok=True)
        self.partial_dir.mkdir(exist_ok=True)
        tmp = self.partial_dir / f"{cell_id}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        tmp.mkdir()
        record = {"store_version": VERSION, "cell_id": cell_id, **meta}
        _write_synced(tmp / "cell.json", json.dumps(record, indent=2, default=str) + "\n")
        _write_synced(tmp / "rows.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rows))
        _write_synced(tmp / DONE, "")
        _fsync_dir(tmp)
        final = self.cell_dir(cell_id)
        if final.exists() and not self.has(cell_id):
            # A cell folder without `done` can only come from outside the store (e.g. a partial copy):
            # keep it, out of the way, rather than delete it.
            final.rename(self.partial_dir / f"{cell_id}.unfinished.{time.time_ns()}")
        try:
            tmp.rename(final)
        except OSError as err:
            if not self.has(cell_id):
                raise StoreError(f"could not move finished cell {tmp} to {final}: {err}") from err
            shutil.rmtree(tmp)  # finished by another process first: drop our duplicate
            return final
        _fsync_dir(self.cells_dir)
        return final

    def read_meta(self, cell_id: str) -> dict[str, Any]:
        return json.loads((self.cell_dir(cell_id) / "cell.json").read_text(encoding="utf-8"))


def open_existing(root: str | os.PathLike) -> ResultsStore:
    """Open a store for reading; a directory that is not a store is an error, never created."""
    path = Path(root).expanduser()
    if not (path / MANIFEST).exists():
        raise StoreError(f"{path} is not a specdec results store (no {MANIFEST}); run a grid into it first")
    return ResultsStore(path)


def load_rows(root: str | os.PathLike):
    """Every row of every finished cell as one pandas DataFrame (one row per question turn)."""
    import pandas as pd

    store = open_existing(root)
    frames = [pd.read_json(store.cell_dir(c) / "rows.jsonl", lines=True, dtype=False) for c in store.cell_ids()]
    if not frames:
        raise StoreError(f"{store.root} has no finished cells yet")
    return pd.concat(frames, ignore_index=True)
