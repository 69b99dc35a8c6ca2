"""The measurement records and their generated pages; the README's front-door limits."""

import importlib
import json
import re
from pathlib import Path

import pytest
import torch

from specdec import machine
from specdec.measure import records

REPO = Path(__file__).resolve().parents[1]


def _generator():
    return importlib.import_module("scripts.measurements")


KEY = "cpu-AuthenticAMD-f25-m17-avx2-avx512f"
MACHINE = {"name": "AMD EPYC", "vendor": "AuthenticAMD", "family": "25", "model": "17",
           "isa": ["avx2", "avx512f"], "key": KEY, "cores": 2}


def _record(**changes):
    record = {"schema": records.SCHEMA, "kind": "kernels", "date": "2026-12-04 10:00 UTC",
              "command": "python scripts/bench_kernels.py --specs none --widths 1,8", "machine": MACHINE,
              "threads": 1, "versions": {"python": "3.12.3", "torch": "2.13.0+cpu"}, "commit": "f668003",
              "result": {"bench": "kernels", "repeats": 5, "widths": [1, 8],
                         "results": [{"spec": "none", "auto": "onednn", "seconds": 0.0686}]}}
    record.update(changes)
    return record


def _write(path: Path, *recs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_generator_renders_machine_date_command_and_result(tmp_path):
    gen = _generator()
    key = KEY
    older = _record(date="2026-12-03 09:00 UTC", command="python scripts/bench_kernels.py --repeats 3")
    _write(tmp_path / "results" / f"{key}.jsonl", older, _record())
    assert gen.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path)]) == 0
    text = (tmp_path / f"{key}.md").read_text()
    assert text.startswith(gen.MARKER)
    assert '`lscpu` model name "AMD EPYC", AuthenticAMD, family 25 model 17; ISA flags avx2 avx512f; 2 cores' in text
    assert "## kernels" in text and "### 2026-12-04 10:00 UTC" in text
    assert "```bash\npython scripts/bench_kernels.py --specs none --widths 1,8\n```" in text
    assert "threads 1; python 3.12.3, torch 2.13.0+cpu; commit f668003" in text
    assert "- `widths`: 1, 8" in text
    assert "| spec | auto | seconds |" in text and "| none | onednn | 0.0686 |" in text
    assert text.index("### 2026-12-04 10:00") < text.index("### 2026-12-03 09:00"), "newest record first"
    assert f"source: [results/{key}.jsonl](results/{key}.jsonl)" in text
    assert gen.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path), "--check"]) == 0
    _write(tmp_path / "results" / f"{key}.jsonl", _record())
    assert gen.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize("missing", ["machine", "command"])
def test_generator_refuses_a_record_without_machine_or_command(tmp_path, missing, capsys):
    gen = _generator()
    bad = _record()
    del bad[missing]
    _write(tmp_path / "results" / f"{KEY}.jsonl", _record(), bad)
    assert gen.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{KEY}.jsonl:2: record lacks '{missing}'" in err
    assert not list(tmp_path.glob("*.md")), "nothing is written when a record is refused"
    with pytest.raises(records.RecordError, match="lacks name, key"):
        records.validate(_record(machine={"family": "25"}), where="x")


def test_generator_refuses_a_record_filed_under_another_machine(tmp_path, capsys):
    _write(tmp_path / "results" / "cpu-GenuineIntel-f6-m143-avx2.jsonl", _record())
    assert _generator().main(["--results", str(tmp_path / "results"), "--out", str(tmp_path)]) == 2
    assert f"measured on machine {KEY!r}, not 'cpu-GenuineIntel-f6-m143-avx2'" in capsys.readouterr().err


def test_append_writes_one_line_per_record_and_refuses_the_checkout_under_pytest(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_RECORDS", raising=False)
    with pytest.raises(records.RecordError, match="SPECDEC_RECORDS"):
        records.append("demo", {"x": 1}, ["python", "scripts/demo.py"])
    path = records.append("demo", {"x": 1}, ["python", "scripts/demo.py", "--shapes", "chain(4);auto"], root=tmp_path)
    records.append("demo", {"x": 2}, ["python", "scripts/demo.py"], root=tmp_path, note="busy")
    got = records.read(path)
    assert [r["result"]["x"] for r in got] == [1, 2]
    assert got[0]["command"] == "python scripts/demo.py --shapes 'chain(4);auto'"
    assert got[1]["note"] == "busy" and got[0]["machine"]["name"] == machine.machine_name()
    assert path == tmp_path / f"{machine.machine_key()}.jsonl" and got[0]["threads"] == torch.get_num_threads()
    with pytest.raises(records.RecordError, match="a result is a dict"):
        records.append("demo", [1, 2], ["python"], root=tmp_path)


def test_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines, the limit is 200"
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    setup = [line.split("#")[0].strip() for line in blocks[0].splitlines()] if blocks else []
    assert setup == ["bash scripts/install.sh && python -m experiments.main",
                     "bash scripts/install.sh && python -m pytest -q"]


def _names_a_module_or_attribute(name: str) -> bool:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:n])) is None:
                continue
        except ModuleNotFoundError:  # a parent of it is no package
            continue
        rest = parts[n:]
        if not rest:
            return True
        module = importlib.import_module(".".join(parts[:n]))
        return len(rest) == 1 and hasattr(module, rest[0])
    return False


def test_docs_name_only_modules_and_paths_that_exist():
    """Every `specdec.x.y` / `experiments.x` name and every repository path or link the READMEs give exists."""
    for doc in ["README.md", "experiments/README.md", "docs/library.md", "docs/measurements/README.md"]:
        text = (REPO / doc).read_text()
        for name in sorted(set(re.findall(r"\b((?:specdec|experiments)(?:\.[A-Za-z_]+)+)", text))):
            assert _names_a_module_or_attribute(name), f"{doc} names {name}, which is no module or attribute"
        paths = set(re.findall(r"`((?:specdec|experiments|scripts|docs|tests)/[\w./-]+)`", text))
        paths |= set(re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text))
        for path in sorted(paths):
            assert (REPO / path).exists() or (REPO / doc).parent.joinpath(path).exists(), f"{doc} names {path}"


def test_the_checked_in_measurement_pages_are_generated_from_their_records(capsys):
    """docs/measurements/<machine>.md equal what the generator makes of docs/measurements/results/ (no hand edits)."""
    assert _generator().main(["--check"]) == 0, capsys.readouterr().out
