"""`python -m specdec.tune TARGET`: measure this machine's choices once and store them as data.

    python -m specdec.tune smollm2-135m                       # threads, kernel, eagle head dtype, curve
    python -m specdec.tune smollm2-135m --threads 1 --quant torchao_int4 --drafter none
    python -m specdec.tune smollm2-135m --threads 1 --batch 1,8          # + the curve batches of 8 plan with

Owns the measuring: thread count, linear kernel (`kernels.measure_choice`), EAGLE head dtype (`measure_head_dtypes`),
the latency curve `shape="auto"` plans with, and `memory_limit`. Each run writes one fresh record per target in the
machine's store (`specdec.machine`); constructors look these up and never measure. Knows nothing about drafting or
acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import specdec
from specdec import machine
from specdec.quant import parse_spec, weight_bytes
from specdec.runtime import kernels
from specdec.runtime.forwards import CACHES, resolve_cache
from specdec.drafters import eagle
from specdec.loop.decode import generate
from specdec.core.curve import LatencyCurve
from specdec.measure.latency import curve_key, measure_latency

CURVE_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
CURVE_CONTEXTS = (256,)
DECODE_TOKENS = 16
STALE = 1.15
"""A stored record is tuned again (`ensure_tuned`, `--reuse`) when its curve timed again (`probe_record`) is off by more
than this factor either way: a record hours old once read 1.7x off and flipped the main job's verdict, while a fresh
record and its probe agree within a few percent on a quiet core."""
PROBE_REPEATS = 5  # Passes of the probe over the curve's widths (median kept), as the curve had: ~a second here.


def decode_seconds(target: specdec.Target, counts: Sequence[int], repeats: int = 3) -> dict[int, float]:
    """Median seconds per token of plain decoding (`DECODE_TOKENS` from a fixed 64-token prompt) at
    each torch thread count, counts interleaved within each repeat after one warm-up round."""
    prompt = torch.randint(0, target.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[int, list[float]] = {n: [] for n in counts}
    for rep in range(repeats + 1):
        for n in counts:
            torch.set_num_threads(n)
            out = specdec.generate(target, None, prompt, max_new_tokens=DECODE_TOKENS, stop_on_eos=False)
            if rep:
                times[n].append(sum(s.target_time_s for s in out.stats.steps) / len(out.stats.steps))
    return {n: statistics.median(ts) for n, ts in times.items()}


def tune_target(name: str, quant: str | None, threads: int | None, drafters: Sequence[str],
                device: str = "cpu", batches: Sequence[int] = (1,), compiled: bool = False) -> dict:
    """Measure and store one target's choices; returns the record written (plus `notes`)."""
    notes: list[str] = []
    probe = specdec.load_target(name, device=device, quant=quant, kernel="torch", threads=threads or 1)
    label, dtype, dev = probe.label, probe.dtype, probe.device
    try:  # the old record goes before measuring anew; say so when it could not be read
        machine.load_record(label, dev, dtype)
    except machine.TuneError as err:
        notes.append(f"replacing a record that could not be used: {err}")
    machine.record_path(label, dev, dtype).unlink(missing_ok=True)
    cores = os.cpu_count() or 1
    if dev.type == "cpu" and quant in (None, "none"):
        counts = [threads] if threads else list(range(1, cores + 1))
        seconds = decode_seconds(probe, counts) if len(counts) > 1 else {}
        count = min(seconds, key=seconds.get) if seconds else counts[0]
        machine.update_record(label, dev, dtype, threads=count,
                              threads_seconds_per_token={str(n): s for n, s in seconds.items()})
    else:
        count = machine.resolve_threads(threads, machine.load_record(name, dev, dtype))
    torch.set_num_threads(count)
    names = kernels.candidates(dev, dtype)
    if len(names) > 1:
        choice = kernels.measure_choice(probe, names)  # leaves the model on the faster kernel
        machine.update_record(label, dev, dtype, kernel={**choice, "among": names})
    target = specdec.load_target(name, device=device, quant=quant, threads=count)  # as users will get it
    if "eagle" in drafters and dev.type == "cpu" and dtype in eagle.HEAD_DTYPES:
        try:
            head = eagle.EagleHead.load(eagle.shipped_head_path(target))
        except FileNotFoundError as err:
            notes.append(f"head dtype not tuned: {err}")
        else:
            vocab = eagle.DEFAULT_DRAFT_VOCAB if head.draft_vocab.numel() >= eagle.DEFAULT_DRAFT_VOCAB else None
            dtypes = eagle.HEAD_DTYPES if dtype == torch.float32 and quant in (None, "none") else (dtype,)
            per_step = measure_head_dtypes(target, head, vocab, dtypes)
            best = min(per_step, key=per_step.get)
            machine.update_record(label, dev, dtype, head_dtype={eagle.head_geometry(target, head, vocab): {
                "dtype": str(best).removeprefix("torch."),
                "seconds_per_step": {str(d).removeprefix("torch."): s for d, s in per_step.items()}}})
    if compiled and dev.type == "cpu":  # the compiled forward runs plain linears: its choice is the kernel's too
        plain = specdec.load_target(name, device=device, quant=quant, kernel="torch", threads=count)
        choice = machine.update_record(label, dev, dtype, cache=measure_compiled(target, plain))["cache"]
        if choice["cache"] == "compiled":
            machine.update_record(label, dev, dtype, kernel={"kernel": "torch", "compiled": True})
            target = plain
    curves = {}
    for batch in batches:  # one curve per batch size: `shape="auto"` in a batch plans with its own
        kind = resolve_cache("auto", target, batch)  # a batch runs (and is timed) with its own cache
        curve = measure_latency(target, CURVE_WIDTHS, CURVE_CONTEXTS, cache=kind, batch=batch, holes=batch > 1)
        curves[curve_key(target, CURVE_WIDTHS, CURVE_CONTEXTS, 5, kind, batch, batch > 1)] = curve.to_json()
    first = next(iter(curves.values()))  # the first batch size's: a 1-token forward at context 256
    physics = memory_limit(target, first["seconds"][0][0]) if dev.type == "cpu" else {}
    record = machine.update_record(label, dev, dtype, threads=count, curves=curves, physics=physics)
    return {**record, "notes": notes, "path": str(machine.record_path(label, dev, dtype))}


def measure_compiled(target: specdec.Target, plain: specdec.Target, repeats: int = 5, context: int = 64) -> dict:
    """Median seconds of a 1- and an 8-token forward after `context` cached tokens, `dynamic` (eager, on
    `target`'s kernel) and `compiled` (`plain`: the same model on the `torch` kernel, whose linears inductor
    packs itself; buckets 1 and 8), interleaved per repeat after a warm-up round that compiles or reads the
    on-disk cache (its seconds: `compile_seconds`): the `cache` field of a record, naming the faster."""
    prompt = torch.randint(0, target.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    runs = {kind: CACHES[kind](t, context + 16, kernels.CHOICE_WIDTHS) for kind, t in (("dynamic", target),
                                                                                      ("compiled", plain))}
    times: dict[str, dict[int, list[float]]] = {kind: {w: [] for w in kernels.CHOICE_WIDTHS} for kind in runs}
    for rep in range(repeats + 1):
        for kind, (cache, forward) in runs.items():
            if rep == 0:
                forward(prompt, cache)
            for w in kernels.CHOICE_WIDTHS:
                t0 = time.perf_counter()
                forward(prompt[:, :w], cache)
                times[kind][w].append(time.perf_counter() - t0)
                cache.truncate(context)
    seconds = {kind: {str(w): statistics.median(ts[1:]) for w, ts in per.items()} for kind, per in times.items()}
    return {"cache": min(seconds, key=lambda k: sum(seconds[k].values())), "seconds": seconds,
            "widths": list(kernels.CHOICE_WIDTHS), "compile_seconds": sum(t[0] for t in times["compiled"].values()),
            "limit_seconds": read_seconds(weight_bytes(target.model))}


def compare_compiled(name: str, quant: str | None, threads: int, device: str = "cpu") -> dict:
    """A record-shaped dict (not stored) of `measure_compiled` on `name` quantized by `quant`, both on the
    `torch` kernel, so the one difference is the compile: what `--markdown` tabulates."""
    target = specdec.load_target(name, device=device, quant=quant, kernel="torch", threads=threads)
    c = measure_compiled(target, target)
    return {"target": target.label, "dtype": str(target.dtype).removeprefix("torch."), "device": device,
            "threads": threads, "machine": machine.machine_facts(device), "machine_key": machine.machine_key(device),
            "cache": c, "physics": memory_limit(target, c["seconds"]["dynamic"]["1"]), "path": "(not stored)"}


def read_seconds(nbytes: int, repeats: int = 7) -> float:
    """Fastest of `repeats` reads of a resident buffer of `nbytes` (a float32 sum over it) on torch's
    threads after one warm read: the memory-read limit of a forward whose weights take `nbytes`."""
    buffer = torch.ones(max(1, nbytes // 4))
    times = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        buffer.sum()
        if rep:
            times.append(time.perf_counter() - t0)
    return min(times)  # the limit: interference only slows a read


def memory_limit(target: specdec.Target, forward_seconds: float) -> dict:
    """The `physics` field of a record: the weights' stored bytes (`weight_bytes`: each tensor once, tied
    embeddings once, packed formats at their packed size), the time to read that many bytes once on
    the same threads, and the 1-token forward's ratio to it (1.0 = at the memory limit)."""
    nbytes = weight_bytes(target.model)
    limit = read_seconds(nbytes)
    return {"weight_bytes": nbytes, "read_seconds": limit, "read_gb_s": nbytes / limit / 1e9,
            "forward_seconds": forward_seconds, "ratio": forward_seconds / limit, "threads": torch.get_num_threads()}


def stored_record(name: str, threads: int | None = None, device: str = "cpu",
                  quant: str | None = None) -> tuple[dict, str] | None:
    """(record, path) of this machine's tuned record for `name` (quantized by `quant`) at `threads` (None:
    any), else None. A record counts as tuned once `tune_target` wrote its thread count (a record that holds
    only latency curves does not). A quantized target's dtype is its quantization's, known only once it is
    loaded, so each float dtype is looked up."""
    label = name if quant in (None, "none") else f"{name}@{parse_spec(quant).text}"
    for dtype in (torch.float32,) if label == name else (torch.float32, torch.bfloat16, torch.float16):
        record = machine.load_record(label, device, dtype)
        if record is not None and record.get("threads") is not None and threads in (None, record["threads"]):
            return record, str(machine.record_path(label, device, dtype))
    return None


def record_curve(record: dict) -> LatencyCurve:
    """The batch-1 curve `tune_target` stored in a tune record (its own grid first); LookupError without one."""
    grid = f"_w{'-'.join(map(str, CURVE_WIDTHS))}_c{'-'.join(map(str, CURVE_CONTEXTS))}_r5"
    curves = sorted(((not key.endswith(grid), key), LatencyCurve.from_json(c, key))
                    for key, c in (record.get("curves") or {}).items())
    found = [c for _, c in curves if c.batch == 1 and not c.holes]
    if not found:
        raise LookupError(f"the tune record of {record.get('target')} holds no batch-1 latency curve")
    return found[0]


def probe_record(name: str, record: dict, device: str = "cpu", quant: str | None = None) -> float:
    """How far `record_curve(record)` is from this machine now: its row at its smallest context timed again as it was
    (`PROBE_REPEATS` passes over its widths, its threads and cache kind), the geometric mean over widths of now over
    stored (nan for a record without such a curve)."""
    try:
        curve = record_curve(record)
    except LookupError:
        return float("nan")
    target = specdec.load_target(name, device=device, quant=quant, threads=record["threads"])
    kind = resolve_cache("auto", target, 1)
    now = measure_latency(target, curve.widths, curve.contexts[:1], PROBE_REPEATS, cache=kind)
    return statistics.geometric_mean(now.at(w) / curve.at(w, curve.contexts[0]) for w in curve.widths)


def ensure_tuned(name: str, threads: int | None = None, drafters: Sequence[str] = ("eagle",),
                 device: str = "cpu", quant: str | None = None) -> dict:
    """What a benchmark or the main job calls first: the stored record for `name` (quantized by `quant`) on this machine
    when a quick probe agrees with its curve within `STALE`, else `tune_target` now (also when `threads` asks for
    another count than it holds). Says which on stdout, so the choices a run used are visible; returns the record
    (with `notes` when it was tuned now). A stale record that timed the compiled forward (`tune --compile`) is tuned
    again with it, so the compiled choice is measured again rather than dropped."""
    stored = stored_record(name, threads, device, quant)
    compiled = stored is not None and "cache" in stored[0]
    flags = f"{f' --quant {quant}' if quant else ''}{f' --threads {threads}' if threads else ''}"
    said = f"tuning {name}{f'@{quant}' if quant else ''} first (python -m specdec.tune {name}{flags})"
    if stored is not None:
        ratio = probe_record(name, stored[0], device, quant)
        probe = f"its curve timed again now is {ratio:.2f}x the stored one"
        if 1 / STALE <= ratio <= STALE:  # nan (no curve to check it by) is neither
            print(f"specdec.tune: using the record of {stored[0]['updated']} ({stored[1]}): {probe}, within {STALE}x",
                  flush=True)
            return stored[0]
        said = (f"the record of {stored[0]['updated']} ({stored[1]}) is stale: {probe}, over {STALE}x; tuning again"
                + (" with --compile" if compiled else ""))
    print(f"specdec.tune: {said}", flush=True)
    record = tune_target(name, quant, threads, drafters, device, compiled=compiled)
    print("\n".join(card(record)), flush=True)
    return record


def card(record: dict) -> list[str]:
    """The human-readable lines for one tuned record."""
    lines = [f"{record['target']} ({record['dtype']}, {record['device']}) on {record['machine']['name']} "
             f"[{record['machine_key']}]"]
    per = record.get("threads_seconds_per_token") or {}
    timed = ", ".join(f"{n}: {1 / s:.1f} tok/s" for n, s in per.items())
    lines.append(f"  threads  {record['threads']}" + (f"   (plain decoding {timed})" if timed else " (given)"))
    kernel = record.get("kernel")
    if kernel:
        widths = kernel["widths"]
        ms = ", ".join(f"{n} " + "/".join(f"{1e3 * t[str(w)]:.0f}" for w in widths) for n, t in kernel["seconds"].items())
        lines.append(f"  kernel   {kernel['kernel']}   (ms at widths {'/'.join(map(str, widths))}: {ms})")
    else:
        lines.append("  kernel   only one can run here")
    for geometry, choice in (record.get("head_dtype") or {}).items():
        ms = ", ".join(f"{d} {1e3 * s:.2f}" for d, s in choice["seconds_per_step"].items())
        lines.append(f"  eagle    {choice['dtype']} head   (ms per draft step: {ms}; {geometry})")
    for key, curve in (record.get("curves") or {}).items():
        row = curve["seconds"][0]
        ratios = " ".join(f"{t / row[0]:.2f}" for t in row)
        lines.append(f"  curve    widths {'/'.join(map(str, curve['widths']))}: {ratios} x a 1-token forward "
                     f"({1e3 * row[0]:.0f} ms; {key})")
    if c := record.get("cache"):
        limit = c.get("limit_seconds") or float("nan")
        ms = ", ".join(f"{k} " + "/".join(f"{1e3 * t:.1f} ({t / limit:.2f}x)" for t in ts.values())
                       for k, ts in c["seconds"].items())
        lines.append(f"  forward  {c['cache']}   (ms at widths {'/'.join(map(str, c['widths']))}, x the memory limit: "
                     f"{ms}; compiling or reading its cache took {c.get('compile_seconds', float('nan')):.0f} s)")
    if p := record.get("physics"):
        lines.append(f"  memory   {p['weight_bytes'] / 1e6:.1f} MB as stored, read once in {1e3 * p['read_seconds']:.2f} ms "
                     f"({p['read_gb_s']:.1f} GB/s); 1-token forward {1e3 * p['forward_seconds']:.2f} ms = "
                     f"{p['ratio']:.2f}x the limit ({p['threads']} thread(s))"
                     + _cached(p["weight_bytes"], record["machine"]))
    lines += [f"  note     {n}" for n in record.get("notes", [])]
    lines.append(f"  record   {record['path']}")
    return lines


def _cached(nbytes: int, facts: dict) -> str:
    """`; fits in the N MiB last-level cache` where it does: that limit is a cache read, not a DRAM read."""
    llc = facts.get("llc_mib")
    return f"; fits in the {llc:.0f} MiB last-level cache" if llc and nbytes < llc * 2**20 else ""


def compiled_markdown(records: Sequence[dict], command: str) -> str:
    """A measurement page of `tune --compile` records: eager against compiled, 1- and 8-token forwards, in ms
    and as ratios to each kernel's memory-read limit."""
    m = records[0]["machine"]
    lines = [f"<!-- generated by `{command}`; do not edit by hand -->", "",
             f"# Compiled vs eager decode forwards on {m['name']} ({records[0]['machine_key']})", "",
             f"`lscpu` model name \"{m['name']}\", {m.get('vendor')} family {m.get('family')} model {m.get('model')}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
             f"{records[0]['threads']} thread(s); command: `{command}`.", "",
             "Median ms of a forward after 64 cached tokens, eager (`dynamic`) and `compiled` "
             "(torch.compile, inductor, no freezing), both on the torch kernel, interleaved per repeat; (x) = ms / the "
             "time to read the weights' stored bytes once on the same thread (1.00 = at the memory limit)"
             + (f"; the last-level cache holds {m['llc_mib']:.0f} MiB, so a target whose weights fit is timed against a "
                "cache read" if m.get("llc_mib") else "") + ".", "",
             "| target | weights MB | limit ms | eager 1 | compiled 1 | eager 8 | compiled 8 | compiled/eager 1 | "
             "compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in records if "cache" in r):
        c, limit = r["cache"], r["cache"]["limit_seconds"]
        cells = [f"{1e3 * c['seconds'][k][w]:.1f} ({c['seconds'][k][w] / limit:.2f}x)" for w in ("1", "8")
                 for k in ("dynamic", "compiled")]
        lines.append(f"| {r['target']} | {r['physics']['weight_bytes'] / 1e6:.0f} | {1e3 * limit:.1f} | "
                     f"{' | '.join(cells)} | {c['seconds']['compiled']['1'] / c['seconds']['dynamic']['1']:.2f} | "
                     f"{c['compile_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def measure_head_dtypes(target: specdec.Target, head: eagle.EagleHead, draft_vocab: int | None,
                        dtypes: Sequence[torch.dtype] = eagle.HEAD_DTYPES, repeats: int = 3,
                        new_tokens: int = 12) -> dict[torch.dtype, float]:
    """Median drafting seconds per step of a greedy chain(3) generation from a random 48-token prompt,
    per head dtype of `dtypes` (interleaved, one warm-up round): timed inside decoding, where the target's forward
    between two drafts has evicted the head's weights from the caches, as it does in use. A quantized target's
    record keeps its one dtype's: what `experiments.predict` scales the drafting of a kernel cell by."""
    prompt = torch.randint(0, target.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    drafters = {dtype: eagle.EagleDrafter(head, target=target, draft_vocab=draft_vocab, head_dtype=dtype)
                for dtype in dtypes}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in dtypes}
    for rep in range(repeats + 1):
        for dtype, drafter in drafters.items():
            steps = generate(target, drafter, prompt, shape="chain(3)", max_new_tokens=new_tokens, stop_on_eos=False,
                             cache="dynamic").stats.steps[1:]  # the first step also runs the prompt through the head
            if rep and steps:
                times[dtype].append(statistics.median(s.draft_time_s for s in steps))
    return {dtype: statistics.median(ts) for dtype, ts in times.items()}


def _kernel(record: dict) -> str:
    """The linear kernel a record chose ("only" where one could run)."""
    return (record.get("kernel") or {}).get("kernel", "only")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.tune", description=__doc__.split("\n")[0])
    parser.add_argument("target", help="a load_target name or path, e.g. smollm2-135m")
    parser.add_argument("--quant", default="", help="also tune these quantized targets (comma-separated specs)")
    parser.add_argument("--threads", type=int, default=None, help="use this many threads instead of measuring")
    parser.add_argument("--drafter", default="eagle", help="drafters whose choices to tune (comma-separated; "
                        "'none' for none); only eagle has one (its head dtype)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", default="1", help="batch sizes to measure latency curves at (comma-separated; "
                        "`generate_batch(shape='auto')` plans with the curve of its batch size)")
    parser.add_argument("--compile", action="store_true", help="also time the compiled forward (torch.compile: "
                        "minutes on a first run, then cached on disk) against the eager one; `cache='auto'` runs the faster")
    parser.add_argument("--markdown", default="", help="only time eager against compiled forwards of "
                        "the target and each --quant (torch kernel, nothing stored) and write that page here")
    parser.add_argument("--reuse", action="store_true", help="keep this machine's stored record of each target "
                        "(and --quant target) for these threads when its curve timed again agrees within STALE, else "
                        "tune it now (print which)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    drafters = [d for d in args.drafter.split(",") if d and d != "none"]
    try:
        if args.threads is not None:
            machine.resolve_threads(args.threads, None)
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
        if not batches or min(batches) < 1:
            raise ValueError(f"--batch needs batch sizes >= 1, got {args.batch!r}")
        unknown = [d for d in drafters if d not in specdec.drafters.names()]
        if unknown:
            raise ValueError(f"unknown drafter {unknown[0]!r}; registered: {', '.join(specdec.drafters.names())}")
        specs = [q.strip() for q in args.quant.split(",") if q.strip()]
        if args.markdown:  # eager against compiled only, per target, on the given threads (no other tuning)
            records = [compare_compiled(args.target, spec, args.threads or 1, args.device) for spec in [None, *specs]]
            command = "python -m specdec.tune " + " ".join(argv if argv is not None else sys.argv[1:])
            page = compiled_markdown(records, command)
            Path(args.markdown).write_text(page)
            print(page, flush=True)
            return 0
        if args.reuse:
            record = ensure_tuned(args.target, args.threads, drafters, args.device)
            quantized = [ensure_tuned(args.target, record["threads"], drafters, args.device, spec) for spec in specs]
            said = {r["target"]: {"reused": "notes" not in r, "kernel": _kernel(r)} for r in [record, *quantized]}
            print(json.dumps({"tune": args.target, **said.pop(record["target"]), "threads": record["threads"],
                              "record": str(machine.record_path(args.target, args.device, torch.float32)),
                              **({"quant": said} if specs else {})}))
            return 0
        records = [tune_target(args.target, None, args.threads, drafters, args.device, batches, args.compile)]
        for spec in specs:
            records.append(tune_target(args.target, spec, records[0]["threads"], drafters, args.device, batches,
                                       args.compile))
    except (ValueError, OSError, KeyError) as err:
        print(f"specdec.tune: error: {err}", file=sys.stderr)
        return 2
    for record in records:
        print("\n".join(card(record)))
    summary = {"tune": args.target, "machine": records[0]["machine"]["name"], "machine_key": records[0]["machine_key"],
               "threads": records[0]["threads"], "seconds": round(time.perf_counter() - started, 1),
               "targets": {r["target"]: {"kernel": _kernel(r),
                                         "head_dtype": {g: c["dtype"] for g, c in (r.get("head_dtype") or {}).items()},
                                         "curves": list(r.get("curves", {})), "record": r["path"],
                                         **({"compiled": r["cache"]} if "cache" in r else {}),
                                         **{k: r["physics"][k] for k in ("weight_bytes", "read_gb_s", "forward_seconds",
                                                                         "ratio") if k in r.get("physics", {})},
                                         "width_ms": {w: round(1e3 * t, 2) for c in list(r.get("curves", {}).values())[:1]
                                                      for w, t in zip(c["widths"], c["seconds"][0])}}
                           for r in records}}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
