"""The results store: one directory per finished cell, written atomically, readable with pandas.

Layout (version 1): RESULTS/STORE.json, RESULTS/cells/<cell_id>/{cell.json, rows.jsonl, done (written last)},
RESULTS/.partial/ (cells being written), RESULTS/hydra/ (Hydra's logs). A cell is written under .partial/, then
renamed into cells/: the atomic rename is also the claim between concurrent writers; nothing in cells/ is overwritten.
Owns none of the measuring: rows arrive as plain dicts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import warnings
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


class DamagedCellError(StoreError):
    """A finished cell whose files cannot be read back whole (raised by `load_rows(on_damage="raise")`)."""


class DamagedCellWarning(UserWarning):
    """A finished cell skipped by `load_rows` because its files cannot be read back whole."""


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
            # Another process may be creating the same store right now: its temporary manifest is
            # not foreign, and once its manifest is in place the directory is a store.
            foreign = sorted(p.name for p in self.root.iterdir()
                             if p.name not in _FOREIGN_OK and not p.name.startswith(f".{MANIFEST}."))
            if manifest.exists():
                self._check_manifest(manifest)
                return
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

    def damage(self, cell_id: str) -> str | None:
        """What is wrong with a finished cell's files, or None when both read back whole."""
        cell = self.cell_dir(cell_id)
        try:
            meta = json.loads((cell / "cell.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return "cell.json is missing"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"cell.json is not JSON ({err})"
        if not isinstance(meta, dict):
            return "cell.json is not a JSON object"
        try:
            text = (cell / "rows.jsonl").read_text(encoding="utf-8")
        except FileNotFoundError:
            return "done marker without rows (rows.jsonl is missing)"
        except (OSError, UnicodeDecodeError) as err:
            return f"rows.jsonl is unreadable ({err})"
        if not text.strip():
            return "done marker without rows (rows.jsonl is empty)"
        if not text.endswith("\n"):
            return "rows.jsonl is truncated (its last line is unfinished)"
        for number, line in enumerate(text.splitlines(), 1):
            try:
                if not isinstance(json.loads(line), dict):
                    return f"rows.jsonl line {number} is not a JSON object"
            except json.JSONDecodeError:
                return f"rows.jsonl line {number} is not JSON (truncated or overwritten)"
        return None

    def damaged_cells(self) -> dict[str, str]:
        """Finished cells whose files are damaged: cell id -> what is wrong."""
        return {c: why for c in self.cell_ids() if (why := self.damage(c)) is not None}


def open_existing(root: str | os.PathLike) -> ResultsStore:
    """Open a store for reading; a directory that is not a store is an error, never created."""
    path = Path(root).expanduser()
    if not (path / MANIFEST).exists():
        raise StoreError(f"{path} is not a specdec results store (no {MANIFEST}); run a grid into it first")
    return ResultsStore(path)


def load_rows(root: str | os.PathLike, *, on_damage: str = "warn"):
    """Every row of every finished, undamaged cell as one pandas DataFrame (one row per question turn); a damaged
    cell is skipped with a `DamagedCellWarning` (`on_damage="warn"`) or raises `DamagedCellError` (`"raise"`)."""
    import pandas as pd

    if on_damage not in ("warn", "raise"):
        raise ValueError(f"on_damage must be 'warn' or 'raise', got {on_damage!r}")
    store = open_existing(root)
    frames = []
    for cell_id in store.cell_ids():
        why = store.damage(cell_id)
        if why is not None:
            message = f"damaged cell {cell_id} in {store.root}: {why}"
            if on_damage == "raise":
                raise DamagedCellError(message)
            warnings.warn(f"{message}; skipped (its rows are not in any average)", DamagedCellWarning, stacklevel=2)
            continue
        frames.append(pd.read_json(store.cell_dir(cell_id) / "rows.jsonl", lines=True, dtype=False))
    if not frames:
        raise StoreError(f"{store.root} has no finished cells yet")
    return pd.concat(frames, ignore_index=True)
