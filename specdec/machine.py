"""The machine a measurement belongs to, specdec's cache folder, and the one store of tuned choices.

Owns `machine_name`, `machine_key` (CPU vendor, family, model and ISA flags, or GPU name and capability), `cache_root`
and the tune store (one JSON record per machine key x target; an untrustworthy record is a `TuneError`).
Knows nothing about what the fields mean or how they are measured.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch

SCHEMA = "specdec.tune/1"
DEFAULT_THREADS = 1
"""torch intra-op threads when nothing is tuned and none are asked for: one thread is the fastest
setting for decoding on a small, shared CPU (two threads wait on each other's barriers)."""
DEFAULT_KERNEL = "torch"
"""The linear kernel `kernel="auto"` means when nothing is tuned: the modules as loaded (`F.linear`)."""
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "asimd", "sve")
"""CPU flags that change which kernel runs (and how fast): part of the machine key."""


class TuneError(ValueError):
    """A tune record that cannot be used as it is (the message names the file and what to do)."""


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def machine_name(device: torch.device | str = "cpu") -> str:
    """The processor a timing ran on: `lscpu`'s model name, or the CUDA device name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def device_label(device: torch.device | str = "cpu") -> str:
    """"cpu", or the CUDA device's name: which accelerator, if any, a piece of work ran on."""
    device = torch.device(device)
    return machine_name(device) if device.type == "cuda" else "cpu"


def machine_facts(device: torch.device | str = "cpu") -> dict:
    """What identifies the machine beside its name: vendor, family, model and ISA flags (CPU), or
    the compute capability (CUDA). Recorded with every tuned choice."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"name": machine_name(device), "capability": f"{major}.{minor}"}
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {"name": machine_name(device), "vendor": info.get("vendor_id", platform.machine()),
            "family": info.get("cpu family", "?"), "model": info.get("model", "?"),
            "isa": [f for f in ISA_FLAGS if f in flags], **({"llc_mib": llc} if (llc := _llc_mib()) else {})}


def _llc_mib() -> float | None:
    """The last-level cache in MiB (Linux sysfs; None elsewhere): weights smaller than it are read from it, so a
    memory-read limit measured on them is a cache read."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            size = (index / "size").read_text().strip()
            sizes[int((index / "level").read_text())] = int(size[:-1]) * {"K": 1, "M": 1024}[size[-1]] / 1024
    return sizes[max(sizes)] if sizes else None


def machine_key(device: torch.device | str = "cpu") -> str:
    """A file-name-safe key of what changes a measured answer on `device`: CPU vendor, family, model
    and ISA flags (`cpu-AuthenticAMD-f25-m17-avx2-avx512f-...`), or GPU name and compute capability."""
    facts = machine_facts(device)
    if "capability" in facts:
        key = f"cuda-{facts['name']}-sm{facts['capability'].replace('.', '')}"
    else:
        key = "-".join(["cpu", facts["vendor"], f"f{facts['family']}", f"m{facts['model']}", *facts["isa"]])
    return _safe(key)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@+-]", "-", text)


def cache_root() -> Path:
    """specdec's cache folder: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec"


def record_path(label: str, device: torch.device | str, dtype: torch.dtype) -> Path:
    """Where the record of target `label` on `device` in `dtype` lives for this machine."""
    device = torch.device(device)
    name = _safe(f"{label}_{device.type}_{str(dtype).removeprefix('torch.')}") + ".json"
    return cache_root() / "tune" / machine_key(device) / name


def load_record(label: str, device: torch.device | str, dtype: torch.dtype) -> dict | None:
    """The tuned record of a target on this machine, or None if none was stored. TuneError (naming
    the file) for a record that is unreadable, of another schema, or made on another machine."""
    path = record_path(label, device, dtype)
    if not path.exists():
        return None
    fix = f"delete it or run `python -m specdec.tune {label}` again"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TuneError(f"tune record {path} is unreadable ({err}); {fix}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise TuneError(f"tune record {path} has schema {found!r}, this specdec reads {SCHEMA!r}; {fix}")
    key = machine_key(device)
    if data.get("machine_key") != key:
        raise TuneError(f"tune record {path} was measured on machine {data.get('machine_key')!r}, this is "
                        f"{key!r}; {fix}")
    return data


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (the machine's record folder: no lock file is left behind)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def update_record(label: str, device: torch.device | str, dtype: torch.dtype, **fields) -> dict:
    """Merge `fields` into the target's record (nested dicts one level deep) and write it atomically under the
    machine's lock; returns the record. An untrustworthy existing record is a TuneError."""
    path = record_path(label, device, dtype)
    with _locked(path.parent):
        record = load_record(label, device, dtype) or {
            "schema": SCHEMA, "machine_key": machine_key(device), "machine": machine_facts(device),
            "target": label, "device": str(torch.device(device)), "dtype": str(dtype).removeprefix("torch.")}
        for name, value in fields.items():
            if isinstance(value, dict) and isinstance(record.get(name), dict):
                record[name] = {**record[name], **value}
            else:
                record[name] = value
        record["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        record["torch"] = torch.__version__
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    return record


def resolve_threads(threads: int | str | None, record: dict | None) -> int:
    """The thread count to run with: an explicit int (ValueError if < 1 or more than this machine's
    cores), else the record's tuned count, else DEFAULT_THREADS."""
    if threads in (None, "auto"):
        return int(record["threads"]) if record and "threads" in record else DEFAULT_THREADS
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1 or 'auto', got {threads!r}")
    cores = os.cpu_count() or 1
    if threads > cores:
        raise ValueError(f"threads={threads} is more than this machine's {cores} cores")
    return threads
