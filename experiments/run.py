"""Hydra entry point: compose a cell's config, skip it if stored, else measure it and store it.

    python -m experiments.run -m drafter=ngram,small shape=chain4,dynamic32 quant=none,rtn8,rtn4

Owns a cell's identity (`cell_key`, hashed into the cell id), the per-process cache of targets and drafters, the
latency curves a cell times between its prompts (`CellCurves`), its labels, metadata and summary lines. Never
branches on a drafter or quantization name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from collections import OrderedDict
from importlib import metadata
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

import specdec
from specdec import quant as quantization
from specdec.core.shapes import AutoShape
from specdec.machine import machine_name
from specdec.measure.latency import CurveTimer
from experiments.cell import run_cell
from experiments.leaderboard import cell_summary
from experiments.config import ExperimentConfig, check_keys, register_configs
from experiments.questions import digest, load_questions
from experiments.store import ResultsStore

log = logging.getLogger(__name__)
register_configs()

_TARGETS: OrderedDict[tuple, specdec.Target] = OrderedDict()
_DRAFTERS: dict[tuple, specdec.drafters.Drafter] = {}  # (target key, name, options) -> drafter
PROTOCOL = "paired-2x2/cell-curves"
"""The measuring protocol (in every cell key: cells of an older protocol never match): the paired runs of
`experiments.cell`, and curves each cell times between its units (`CellCurves`)."""
REFERENCE_QUANT = "none"
"""The quantization of every cell's reference target (the denominator of its quant and compound speedups)."""
LIBRARIES = ["specdec", "torch", "transformers", "hydra-core", "omegaconf", "numpy", "pandas", "tqdm"]


# ---- identity -------------------------------------------------------------------------------------


def cell_key(cfg: ExperimentConfig, questions_digest: str) -> dict[str, Any]:
    """Everything that changes a cell's numbers; two configs with equal keys are the same cell."""
    return {
        "model": {"name": cfg.model.name, "device": cfg.model.device, "dtype": cfg.model.dtype,
                  "kernel": cfg.model.kernel},
        "quant": kernel_label(cfg),
        "reference": REFERENCE_QUANT,
        "protocol": PROTOCOL,
        "drafter": {"name": cfg.drafter.name, "options": dict(cfg.drafter.options)},
        "shape": str(specdec.parse_shape(cfg.shape.spec)),
        "sampling": {**{k: getattr(cfg.sampling, k) for k in ("temperature", "top_k", "top_p", "seed")},
                     "max_new_tokens": cfg.max_new_tokens},
        "dataset": {"source": cfg.dataset.source, "questions": questions_digest},
        **({"batch": cfg.batch} if cfg.batch != 1 else {}),  # a batch of one keeps the cells' old ids
    }


def _slug(text: str) -> str:
    """`dynamic(top_k=8,depth=6,budget=32)` -> `dynamictopk8-depth6-budget32`."""
    return re.sub(r"[^A-Za-z0-9.-]+", "", text.replace("=", "").replace(",", "-")) or "x"


def cell_id(key: dict[str, Any]) -> str:
    """Readable prefix + hash of the key, e.g. `tiny-llama__ngram__chain4__none__T0__1a2b3c4d5e`."""
    digest_ = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    names = [Path(key["model"]["name"]).name, drafter_label(**key["drafter"]), key["shape"], key["quant"]]
    parts = [*map(_slug, names), f"T{key['sampling']['temperature']:g}",
             *([f"b{key['batch']}"] if key.get("batch", 1) != 1 else []), digest_]
    return "__".join(parts)


# ---- provenance -----------------------------------------------------------------------------------


def git_state() -> dict[str, Any]:
    """Commit and dirtiness of the checkout this code runs from (None + the reason when unknown)."""
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return {"commit": None, "dirty": None, "error": f"{type(err).__name__}: {err}"}
    return {"commit": commit, "dirty": bool(dirty)}


def hardware() -> dict[str, Any]:
    import torch

    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": machine_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# ---- the cell -------------------------------------------------------------------------------------


def _target_key(cfg: ExperimentConfig, spec: str | None = None) -> tuple:
    return (cfg.model.name, cfg.model.device, cfg.model.dtype, cfg.model.kernel,
            cfg.quant.spec if spec is None else spec)


def is_reference(spec: str) -> bool:
    """True when `spec` quantizes nothing (the target is the unquantized reference)."""
    return quantization.parse_spec(spec).text == REFERENCE_QUANT


def drafter_label(name: str, options: dict) -> str:
    """The cell's drafter name: a boolean option switched on names a variant of the drafter (`eagle[head_quant]`:
    its own row in every table); other options are in the cell key only."""
    flags = [k for k, v in sorted(options.items()) if v is True]
    return f"{name}[{','.join(flags)}]" if flags else name


def kernel_label(cfg: ExperimentConfig) -> str:
    """The cell's kernel name: `quant.label` when set (an A/A control), else the canonical spec."""
    return cfg.quant.label or quantization.parse_spec(cfg.quant.spec).text


def quant_labels(spec: str, target: specdec.Target, label: str = "") -> dict[str, Any]:
    """The kernel label, the bits (the spec's, else the dtype's width), whether the backend only simulates the numerics
    (weights stored dequantized) and whether the cell is an A/A control (the reference under another label)."""
    parsed = quantization.parse_spec(spec)
    bits = parsed.bits if parsed.bits is not None else torch.finfo(target.dtype).bits
    numerics_only = not quantization.get(parsed.backend).packed and not is_reference(spec)
    control = bool(label) and label != parsed.text and is_reference(spec)
    return {"quant": label or parsed.text, "bits": float(bits), "numerics_only": numerics_only, "control": control}


def model_sizes(target: specdec.Target) -> dict[str, Any]:
    """What a roofline needs: parameters, weight bytes (packed formats at their real size), layers,
    KV heads, head dimension and KV element size."""
    config = target.model.config
    heads = config.num_attention_heads
    return {
        "params": sum(p.numel() for p in target.model.parameters()),
        "weight_bytes": quantization.weight_bytes(target.model),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "kv_bytes_per_element": torch.finfo(target.dtype).bits // 8,
    }


def curve_widths(cfg: ExperimentConfig) -> tuple[int, ...]:
    """`runner.latency_widths` plus the width of the shape's full draft (not for `auto`), so the cost model never
    interpolates across a kernel's cost step where most verifications are."""
    shape = specdec.parse_shape(cfg.shape.spec)
    extra = set() if isinstance(shape, AutoShape) else {shape.max_nodes + 1}
    return tuple(sorted(set(cfg.runner.latency_widths) | extra))


class CellCurves:
    """The latency curves a cell stores (its target's and its reference's, at the cell's batch and every
    fewer rows), timed through `cache="auto"` in `CurveTimer` passes taken between the cell's units:
    ceil(`runner.latency_repeats` / units) after each, so each curve sees the machine its runs saw."""

    def __init__(self, cfg: ExperimentConfig, targets: dict[str, specdec.Target], units: int) -> None:
        self.per_unit = -(-cfg.runner.latency_repeats // units)
        cache = "static" if cfg.batch > 1 else "auto"
        timers: dict[int, dict[int, CurveTimer]] = {}  # id(target) -> rows -> timer (one per target object)
        self.roles: dict[str, dict[int, CurveTimer]] = {}
        for role, target in targets.items():
            if id(target) not in timers:
                log.info("latency curves of %s at 1..%d rows", target.label, cfg.batch)
                timers[id(target)] = {
                    rows: CurveTimer(target, widths=curve_widths(cfg), contexts=tuple(cfg.runner.latency_contexts),
                                     cache=cache, batch=rows, holes=cfg.batch > 1)
                    for rows in range(1, cfg.batch + 1)}
            self.roles[role] = timers[id(target)]
        self.timers = [t for by_rows in timers.values() for t in by_rows.values()]

    def after_unit(self) -> None:
        """A unit's runs have ended: its passes, every timer alike."""
        for _ in range(self.per_unit):
            for timer in self.timers:
                timer.sample()

    def to_json(self) -> dict:
        """{role: the curve at the cell's batch} and, for a batch, {role_rows: {r: the curve at r rows}}
        for r = 1 .. batch - 1."""
        out = {}
        for role, by_rows in self.roles.items():
            batch = max(by_rows)
            out[role] = by_rows[batch].curve().to_json()
            if batch > 1:
                out[f"{role}_rows"] = {str(r): by_rows[r].curve().to_json() for r in range(1, batch)}
        return out


def load_cached_target(cfg: ExperimentConfig, spec: str | None = None) -> specdec.Target:
    """The cell's target (quantized by `spec`, default the cell's), loaded once per (model, device, dtype, quant) per
    process (LRU of `runner.target_cache_size`; evicting a target drops the drafters built for it)."""
    key = _target_key(cfg, spec)
    if key in _TARGETS:
        _TARGETS.move_to_end(key)
        return _TARGETS[key]
    while len(_TARGETS) >= max(1, cfg.runner.target_cache_size):
        evicted, _ = _TARGETS.popitem(last=False)
        for drafter_key in [k for k in _DRAFTERS if k[0] == evicted]:
            del _DRAFTERS[drafter_key]
    log.info("loading target %s (quant=%s)", cfg.model.name, key[-1])
    _TARGETS[key] = specdec.load_target(cfg.model.name, device=cfg.model.device, dtype=cfg.model.dtype,
                                        kernel=cfg.model.kernel, quant=key[-1],
                                        threads=cfg.runner.threads or "auto")
    return _TARGETS[key]


def build_cached_drafter(cfg: ExperimentConfig, target: specdec.Target,
                         spec: str | None = None) -> specdec.drafters.Drafter:
    """The cell's drafter for `target`, built once per (target, name, options) per process (`generate` resets it)."""
    key = (_target_key(cfg, spec), cfg.drafter.name, json.dumps(cfg.drafter.options, sort_keys=True, default=str))
    if key not in _DRAFTERS:
        _DRAFTERS[key] = specdec.drafters.build(cfg.drafter.name, target=target, **cfg.drafter.options)
    return _DRAFTERS[key]


def run_experiment(cfg: DictConfig) -> str:
    """Run one cell (skipping it when the store has it) and print its one-line summary. Returns the cell id."""
    check_keys(cfg)
    OmegaConf.set_readonly(cfg, True)
    exp: ExperimentConfig = OmegaConf.to_object(cfg)
    if exp.runner.threads:
        torch.set_num_threads(exp.runner.threads)
    if exp.drafter.name not in specdec.drafters.names():
        raise KeyError(f"drafter {exp.drafter.name!r} (from drafter={exp.drafter.name}) is not registered; "
                       f"registered drafters: {', '.join(specdec.drafters.names())}")
    store = ResultsStore(exp.results.dir)
    questions = load_questions(exp.dataset)
    key = cell_key(exp, digest(questions))
    cid = cell_id(key)
    if store.has(cid):
        log.info("cell %s is already stored: skipped", cid)
        print(cell_summary(store, cid), flush=True)
        return cid

    started = time.time()
    own_reference = is_reference(exp.quant.spec) and not exp.quant.label  # the fp32 cell: its own reference
    reference = None if own_reference else load_cached_target(exp, REFERENCE_QUANT)
    target = load_cached_target(exp)
    drafter = build_cached_drafter(exp, target)
    reference_drafter = None if own_reference else build_cached_drafter(exp, reference, REFERENCE_QUANT)
    turns = len(questions) if exp.batch > 1 else sum(len(q.turns) for q in questions)  # a batch runs first turns
    units = -(-len(questions) // exp.batch) if exp.batch > 1 else turns
    curves = CellCurves(exp, {"target": target, **({"reference": reference} if reference is not None else {})}, units)
    with tqdm(total=turns, desc=f"{drafter_label(**key['drafter'])} {key['shape']} {key['quant']}", unit="turn",
              leave=False, disable=not exp.runner.progress, position=1) as bar:
        rows = run_cell(target, drafter, questions, shape=key["shape"], sampling=exp.sampling,
                        max_new_tokens=exp.max_new_tokens, reference=reference,
                        reference_drafter=reference_drafter, warmup_tokens=exp.runner.warmup_tokens,
                        teacher_forcing=exp.runner.teacher_forcing and exp.sampling.temperature == 0,
                        on_unit=lambda turns: (bar.update(turns), curves.after_unit()),
                        batch=exp.batch)
    labels = {
        "cell_id": cid, "model": exp.model.name, "drafter": drafter_label(**key["drafter"]), "shape": key["shape"],
        **quant_labels(exp.quant.spec, target, exp.quant.label), "dataset": exp.dataset.name or exp.dataset.source,
        "dataset_source": exp.dataset.source, "prompts": key["dataset"]["questions"],
        **key["sampling"], "batch": exp.batch,
    }
    meta = {
        "key": key,
        "labels": labels,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "overrides": list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None,
        "git": git_state(),
        "hardware": hardware(),
        "versions": versions(),
        "target_info": target.info,
        "latency": curves.to_json(),
        "model_sizes": {"target": model_sizes(target),
                        **({"reference": model_sizes(reference)} if reference is not None else {})},
        "questions": [q.question_id for q in questions],
        "started_unix": started,
        "wall_time_s": time.time() - started,
    }
    path = store.write_cell(cid, meta, [{**labels, **row} for row in rows])
    log.info("stored %s", path)
    print(cell_summary(store, cid), flush=True)
    return cid


class CellProgress(Callback):
    """A progress bar over the cells of a multirun (exact with the basic launcher, which runs every
    cell in this process), and the store check before the first cell."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.total = self.done = 0
        self.failed: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the bar: it writes to this process's stderr (Ray and submitit pickle callbacks per job)."""
        return {**self.__dict__, "bar": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        ResultsStore(config.results.dir)  # an incompatible store fails here, before any cell runs
        params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
        self.total = sum(len(batch) for batch in BasicSweeper.split_arguments(overrides, None))
        self.bar = tqdm(total=self.total, desc="cells", unit="cell", position=0, disable=not config.runner.progress)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value  # the exception; `return_value` would raise it
            self.failed.append(f"{' '.join(job_return.overrides or [])}: {type(error).__name__}: {error}")
            log.error("cell failed: %s", self.failed[-1])
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        if self.done == self.total:  # the last cell: the sweeper raises after it if any failed
            self._finish()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def _finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.failed:
            log.error("%d cell(s) failed, the others are stored:\n  %s", len(self.failed), "\n  ".join(self.failed))
            self.failed = []


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_experiment(cfg)


if __name__ == "__main__":
    from experiments.launchers import LauncherError, check_launcher

    try:
        check_launcher(sys.argv[1:])  # a missing plugin or an absent Ray cluster, said before Hydra starts
    except LauncherError as err:
        print(f"experiments.run: error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
