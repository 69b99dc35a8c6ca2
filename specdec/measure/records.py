"""Result records: what a benchmark measured, with the machine, date and command it ran under.

Owns the record format (JSON lines), `append` / `emit` (to `<root>/<machine key>.jsonl`; root `root=`, else
`$SPECDEC_RECORDS`, else docs/measurements/results/, never under pytest) and `read` / `validate`. Knows nothing
about what a benchmark measures or how records are rendered.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from specdec import machine

SCHEMA = "specdec.measure.records/1"
REQUIRED = ("schema", "kind", "date", "command", "machine", "result")
"""Keys every record carries; `validate` refuses a record without one of them."""
MACHINE_REQUIRED = ("name", "key")  # Keys every record's `machine` carries.


class RecordError(ValueError):
    """A records file or record that does not say what, where or how it was measured."""


def describe_machine(device: str = "cpu") -> dict:
    """The machine a measurement runs on: `specdec.machine`'s facts (name, vendor, family, model and
    ISA flags, or the GPU's name and capability), its key, and the CPU count."""
    return {**machine.machine_facts(device), "key": machine.machine_key(device), "cores": os.cpu_count()}


def default_root() -> Path:
    """Where `append` writes without `root=`: `$SPECDEC_RECORDS`, else the checkout's `docs/measurements/results`."""
    if os.environ.get("SPECDEC_RECORDS"):
        return Path(os.environ["SPECDEC_RECORDS"])
    if "PYTEST_CURRENT_TEST" in os.environ:
        raise RecordError("a test is about to write a result record into the checkout's docs/measurements/results: "
                          "pass root= or set SPECDEC_RECORDS to a temporary directory")
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "pyproject.toml").is_file():
        raise RecordError(f"specdec is not run from a source checkout ({checkout} has no pyproject.toml): "
                          "pass root= or set SPECDEC_RECORDS")
    return checkout / "docs" / "measurements" / "results"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it: `python -m MODULE ...` or `python PATH ...` (PATH relative
    to the working directory), from `argv` or, by default, from how this process was started."""
    if argv is not None:
        return shlex.join(argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        script = Path(sys.argv[0])
        try:
            script = script.resolve().relative_to(Path.cwd())
        except ValueError:
            pass
        head = ["python", str(script)]
    return shlex.join([*head, *sys.argv[1:]])


def make_record(kind: str, result: dict, argv: list[str] | None = None, *, device: str = "cpu",
                threads: int | str | None = None, note: str | None = None) -> dict:
    """One record: `result` with the kind, UTC date, command line, machine, versions and torch threads
    (`threads`: default this process's `torch.get_num_threads()`)."""
    import torch

    if not isinstance(result, dict):
        raise RecordError(f"a result is a dict (the benchmark's JSON line), not {type(result).__name__}")
    record = {
        "schema": SCHEMA,
        "kind": kind,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(argv),
        "machine": describe_machine(device),
        "threads": torch.get_num_threads() if threads is None else threads,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "commit": _git_commit(),
        "result": result,
    }
    if note:
        record["note"] = note
    return record


def append(kind: str, result: dict, argv: list[str] | None = None, *, root: str | Path | None = None,
           device: str = "cpu", threads: int | str | None = None, note: str | None = None) -> Path:
    """Append one record of `result` to `<root>/<machine-key>.jsonl`; returns that file's path. `argv`: the command
    (default this process's, `command_line`); `device`: the torch device timed (`cuda` adds the GPU to the key)."""
    record = make_record(kind, result, argv, device=device, threads=threads, note=note)
    validate(record, where="new record")
    root = Path(root) if root is not None else default_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{record['machine']['key']}.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def emit(kind: str, result: dict, *, device: str = "cpu", threads: int | str | None = None) -> None:
    """A benchmark's last step: record `result` (`append`; `threads` as there) and print it as the run's JSON line."""
    append(kind, result, device=device, threads=threads)
    print(json.dumps(result), flush=True)


def validate(record: object, where: str) -> dict:
    """`record` if it names its kind, date, command and machine; else a `RecordError` naming `where`."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: a record is a JSON object, not {type(record).__name__}")
    missing = [k for k in REQUIRED if k not in record or record[k] in (None, "", [])]
    if missing:
        raise RecordError(f"{where}: record lacks {', '.join(repr(k) for k in missing)} "
                          f"(every record names {', '.join(REQUIRED)})")
    if record["schema"] != SCHEMA:
        raise RecordError(f"{where}: record schema {record['schema']!r}, expected {SCHEMA!r}")
    machine = record["machine"]
    if not isinstance(machine, dict) or any(not machine.get(k) for k in MACHINE_REQUIRED):
        raise RecordError(f"{where}: record's machine {machine!r} lacks {', '.join(MACHINE_REQUIRED)}")
    if not isinstance(record["result"], dict):
        raise RecordError(f"{where}: record's result is {type(record['result']).__name__}, expected an object")
    return record


def read(path: str | Path) -> list[dict]:
    """Every record of one `.jsonl` file, validated; a bad line is a `RecordError` naming file:line."""
    path = Path(path)
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}:{number}: not JSON ({e.msg})") from None
        records.append(validate(record, where=f"{path}:{number}"))
    return records
