"""Spec-Bench's answer format: a results store's drafted runs as `model_answer/<model_id>.jsonl`.

Owns the mapping from stored rows to Spec-Bench's answer records (one line per question, `choices` with per-turn
steps, tokens, wall time and every step's acceptance length). Knows nothing about how rows were measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments.store import StoreError


def model_id(first: pd.Series) -> str:
    """`<model>-<drafter>-<shape>-<quant>` (+ `-b<batch>` in a batch cell), file-name safe: `chain(4)` -> `chain4`."""
    batch = int(first["batch"]) if "batch" in first and pd.notna(first["batch"]) and first["batch"] > 1 else 1
    name = f"{first.model}-{first.drafter}-{first['shape']}-{first.quant}" + (f"-b{batch}" if batch > 1 else "")
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name.replace("(", "").replace(")", ""))


def answers(rows: pd.DataFrame) -> dict[str, list[dict]]:
    """{model id: its Spec-Bench answer records, one per question in store order} for every cell."""
    missing = {"text", "accept_lengths"} - set(rows.columns)
    if missing:
        raise StoreError(f"rows lack {sorted(missing)}: written by an older runner; rerun the cells for "
                         "Spec-Bench output")
    out: dict[str, list[dict]] = {}
    for cell_id, cell in rows.groupby("cell_id", sort=True):
        name = model_id(cell.iloc[0])
        records = out.setdefault(name, [])
        for question_id, turns in cell.groupby("question_id", sort=False):
            turns = turns.sort_values("turn")
            records.append({"question_id": question_id, "category": turns.category.iloc[0],
                            "answer_id": f"{cell_id}/{question_id}", "model_id": name,
                            "choices": [{"index": 0, "turns": list(turns.text),
                                         "decoding_steps": [int(s) for s in turns.steps],
                                         "new_tokens": [int(n) for n in turns.new_tokens],
                                         "wall_time": [float(w) for w in turns.wall_time_s],
                                         "accept_lengths": [int(a) for lengths in turns.accept_lengths
                                                            for a in lengths]}]})
    return out


def write_answers(rows: pd.DataFrame, folder: Path) -> list[Path]:
    """Write FOLDER/<model_id>.jsonl for every cell of `rows`; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, records in answers(rows).items():
        paths.append(folder / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return paths
