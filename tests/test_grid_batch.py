"""The grid's batch axis: `batch=1,2` runs one cell per batch size, a batch cell's rows are groups
decoded with `generate_batch` as paired 2x2s, and a batch of one keeps the cells' old identity."""

from __future__ import annotations


from experiments.store import load_rows

from tests.test_experiments import extra_conf, run_grid  # noqa: F401  (fixture)


def test_batch_axis_runs_paired_batches(tmp_path, extra_conf):  # noqa: F811
    results = tmp_path / "results"
    done = run_grid(results, "drafter=ngram", "shape=chain4", "quant=torchao_int4", "max_new_tokens=6", "batch=1,2",
                    "dataset.question_ids=[smoke-1,smoke-2,smoke-3,smoke-4]", extra_conf=extra_conf)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = load_rows(results)
    assert sorted(rows.batch.unique()) == [1, 2] and rows.cell_id.nunique() == 2
    one, two = rows[rows.batch == 1], rows[rows.batch == 2]
    prefix = one.cell_id.iloc[0].rsplit("__", 1)[0]  # the readable part: the hash after it may start with b
    assert "__b" not in prefix and two.cell_id.iloc[0].count("__b2__") == 1
    assert len(two) == 2 and (two.rows == 2).all() and two.question_id.str.contains(r"\+").all()
    assert (two.paired).all() and (two.interaction > 0).all()
    # Greedy: a group's plain tokens are its members' plain tokens decoded alone, in order.
    for _, group in two.iterrows():
        members = group.question_id.split("+")
        alone = one.set_index("question_id").loc[members]
        assert group.baseline_new_tokens == alone.baseline_new_tokens.sum()
        # One batch step serves both rows until one leaves: fewer steps than the rows' own, padded widths.
        assert group.batch_steps <= group.steps and sum(group.batch_verify_widths.values()) == group.batch_steps
        assert set(group.baseline_batch_verify_widths) == {"1"}
        assert sum(group.batch_verify_shapes.values()) == group.batch_steps
        assert {shape.split("x")[0] for shape in group.batch_verify_shapes} <= {"1", "2"}
        # The target's forward seconds per shape: the same shapes, inside what the steps took outside drafting.
        for run in ("", "baseline_"):
            forwards = group[f"{run}batch_shape_forward_s"]
            assert set(forwards) == set(group[f"{run}batch_verify_shapes"]) and min(forwards.values()) > 0
            assert sum(forwards.values()) < group[f"{run}batch_verify_time_s"]
    # The report reads the store: a section per batch size, and the cost model predicts the batch cell from
    # its batch steps (by kernel and by halves of its groups) on its curve measured at batch 2.
    from experiments.report import build_report

    text, verdict, summary, _ = build_report(results, n_boot=100)
    # Drift compares cells of one batch size (a batch's tokens/s is all its rows').
    from experiments.verdict import drift, job_drift

    medians = {b: {c: drift(part)["median"] for c, part in rows[rows.batch == b].groupby("cell_id")} for b in (1, 2)}
    assert summary["drift"] == round(max(job_drift(m) for m in medians.values()), 4)
    assert any("(the most within one batch size)" in line for line in verdict)
    assert "## Speculation against batch size" in text and "| ngram | `chain(4)` |" in text
    for part in ("kernel all (fp32's drafting cost)", "prompts A", "prompts B"):
        # the only batch-2 cell: priced on its own curve (no other cell measured batch 2), so shown, not scored
        assert f"| ngram `chain(4) @b2` torchao_int4_g32 (not scored) | held-out {part} |" in text
    # Projected with one-row curves (the batch-1 cell's own, as if from other hardware), only the batch-1
    # cell is costed; the batch cell says why not.
    import json

    from specdec.core.curve import LatencyCurve

    meta = json.loads((results / "cells" / one.cell_id.iloc[0] / "cell.json").read_text())
    # The batch cell stores its curves at 2 rows and, for the steps after a row has left, at 1 row, timed
    # through the batch's preallocated cache; the batch-1 cell stores one curve per role.
    two_meta = json.loads((results / "cells" / two.cell_id.iloc[0] / "cell.json").read_text())
    for role in ("target", "reference"):
        assert two_meta["latency"][role]["batch"] == 2 and f"{role}_rows" not in meta["latency"]
        assert [c["batch"] for c in two_meta["latency"][f"{role}_rows"].values()] == [1]
        assert two_meta["latency"][role]["holes"] and not meta["latency"][role]["holes"]  # as each ran
    files = []
    for role in ("target", "reference"):
        files.append(str(tmp_path / f"{role}.json"))
        LatencyCurve.from_json({**meta["latency"][role], "machine": "Other"}).save(files[-1])
    projected = build_report(results, n_boot=100, curve_files=tuple(files))[0]
    section = projected.split("## Projected to other hardware")[1].split("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("| ngram chain(4)")]
    assert len(lines) == 2 and "x / " in lines[0] and lines[1].endswith("| – (curves of batch 1) |")


def test_batch_section_shows_speculation_per_batch():
    """The section appears only with two batch sizes and reads each cell's paired ratio per batch."""
    import pandas as pd

    from experiments.batches import batch_section, batch_table

    def row(batch, q, drafted, plain):
        return {"drafter": "ngram", "shape": "chain(4)", "quant": "int4", "batch": batch, "question_id": q,
                "new_tokens": drafted, "wall_time_s": 1.0, "baseline_new_tokens": plain, "baseline_wall_time_s": 1.0,
                "reference_new_tokens": 10, "reference_wall_time_s": 1.0,
                "reference_drafted_new_tokens": 15, "reference_drafted_wall_time_s": 1.0}

    rows = pd.DataFrame([row(1, "a", 20, 10), row(1, "b", 20, 10), row(8, "a+b", 8, 10), row(8, "c+d", 8, 10)])
    table = batch_table(rows, n_boot=200)
    assert table.speculation.round(3).tolist() == [2.0, 0.8] and table.fp32_speculation.round(3).tolist() == [1.5, 1.5]
    assert "| ngram | `chain(4)` | int4 | 8 | 2 | 0.80" in "\n".join(batch_section(rows, n_boot=200))
    assert batch_section(rows[rows.batch == 1]) == []
