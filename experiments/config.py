"""The experiment's structured configs: one dataclass per Hydra group, registered in the ConfigStore.

Owns the strict schema, its registration and a `drafter` preset per registered drafter without a YAML one. Not
`frozen`: Hydra merges presets into them (the runner makes the composed config read-only).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from specdec.core.sampling import SamplingConfig

CONF_DIR = Path(__file__).parent / "conf"


@dataclass
class ModelConfig:
    """The target model."""

    name: str = MISSING
    """Built-in name (`smollm2-135m`, `tiny-llama`, ...), local directory or hub id for `load_target`."""
    device: str = "cpu"  # Device the target (and the drafter) run on.
    dtype: Optional[str] = None  # Weights dtype name (e.g. `float32`); None = the loader's default for that model.
    kernel: str = "auto"
    """What runs the plain linear layers (`specdec.runtime.kernels`): `auto` (measured once per machine), `torch`,
    `onednn`; the one chosen is in each cell's `target_info.kernel`."""


@dataclass
class DrafterConfig:
    """The drafter of a cell: a registry name and the options its factory takes."""

    name: str = MISSING  # A name registered in `specdec.drafters` (`specdec.drafters.names()`).
    options: Dict[str, Any] = field(default_factory=dict)
    """Keyword options for the drafter's factory; add one with `+drafter.options.KEY=VALUE`."""


@dataclass
class ShapeConfig:
    """The draft shape."""

    spec: str = MISSING
    """A shape string for `specdec.parse_shape`: `chain(4)`, `tree(4,2,2)`, `dynamic(top_k=8,depth=6,budget=32)`."""


@dataclass
class QuantConfig:
    """The target's quantization; the plain-loop baseline of a cell runs at the same spec, and the
    unquantized target's plain loop is the cell's reference (the bits label is derived from the spec)."""

    spec: str = "none"
    """A quantization spec for `load_target(quant=...)` (`none`, `bf16`, `torchao_int4`, `rtn4_g64`, ...)."""
    label: str = ""
    """The kernel's name in the store when it must differ from the spec's (empty = the canonical spec). An
    A/A control sets it with spec `none`: the fp32 target measured again, paired against itself."""


@dataclass
class DatasetConfig:
    """Which prompts a cell runs."""

    name: str = ""  # The selection's name in board titles (e.g. `main`); empty = `source`.
    source: str = "default"
    """A suite name in experiments/prompts (`default`, `smoke`), a path to a JSONL file in the
    Spec-Bench / MT-bench question format, or `hf:HUB_ID[:SPLIT]` for a `datasets` hub dataset."""
    categories: List[str] = field(default_factory=list)  # Keep only these categories (empty = all).
    question_ids: List[str] = field(default_factory=list)  # Keep only these question ids, in file order (empty = all).
    per_category: Optional[int] = None
    """Keep at most this many questions per category (first in file order); None = all."""
    max_turns: Optional[int] = None  # Run at most this many turns of each question; None = every turn.


@dataclass
class ResultsConfig:
    """Where results go."""

    dir: str = "results"
    """The results store directory (created on first use); Hydra's logs go to its `hydra/` subfolder."""


@dataclass
class RunnerConfig:
    """How the runner behaves; nothing here changes a measured number, so none of it is in a cell's key."""

    warmup_tokens: int = 4
    """Before timing a cell, one untimed generation of this many tokens, drafted and plain (0 = none)."""
    target_cache_size: int = 3
    """Loaded targets kept in memory across the cells of one multirun (by model and quant spec)."""
    progress: bool = True  # Show tqdm progress bars over cells and prompts.
    latency_widths: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """Widths of the target latency curve stored in every cell (`experiments.run.CellCurves`, timed between the
    cell's prompts); the cost model reads it. Must start at 1."""
    latency_contexts: List[int] = field(default_factory=lambda: [64, 256])  # Context lengths of that curve.
    latency_repeats: int = 11
    """Timed passes over that curve's points (median kept): at least this many, as many after each prompt. The cost
    model takes its shape R(w) = L(w) / L(1), so the median must hold against a slow forward or two on a shared
    machine."""
    teacher_forcing: bool = True
    """At T = 0, also measure acceptance teacher-forced on the fp32 continuation (`experiments.cell`):
    one fp32 acceptance profile per prompt and drafter x shape, one kernel forward per prompt."""
    threads: int = 1
    """torch intra-op threads (0 = torch's default); recorded in every cell's hardware metadata (`torch_threads`)."""


@dataclass
class ExperimentConfig:
    """One cell of the grid: model x drafter x shape x quant x dataset x sampling."""

    model: ModelConfig = MISSING
    drafter: DrafterConfig = MISSING
    shape: ShapeConfig = MISSING
    quant: QuantConfig = MISSING
    dataset: DatasetConfig = MISSING
    sampling: SamplingConfig = MISSING
    """`specdec.SamplingConfig`; question i of a cell uses seed `sampling.seed + i` (both runs)."""
    max_new_tokens: int = 64  # New tokens per turn.
    batch: int = 1
    """Prompts decoded together (`specdec.generate_batch`): the grid's batch axis (`batch=1,8`). A batch
    cell runs first turns only, in groups of `batch` consecutive questions; each run of the paired 2x2
    is one batch, and a row of the cell is one group (`experiments/cell.py`)."""
    results: ResultsConfig = field(default_factory=ResultsConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)


def unknown_keys(cfg: Any, schema: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Keys of a composed config that `schema` does not declare. Hydra's `+key=value` appends a key
    even to a structured node, and `OmegaConf.to_object` would then drop it silently."""
    hints = typing.get_type_hints(schema)
    unknown = []
    for key in cfg.keys():
        if key not in hints:
            unknown.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]):
            unknown += unknown_keys(cfg[key], hints[key], f"{prefix}{key}.")
    return unknown


def check_keys(cfg: Any) -> None:
    """Raise if the composed config has keys outside the schema (e.g. a misspelled `+key=value`)."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise KeyError(f"unknown config key(s) {unknown}: the schema in {__file__} declares no such field "
                       "(misspelled? drafter options go under drafter.options)")


def register_configs(drafter_presets: bool = True) -> None:
    """Store the schema (as `experiment_schema`) and, unless told not to (a quick check that should not import the
    drafters), a `drafter/NAME` preset for every registered drafter without a YAML preset. Idempotent."""
    store = ConfigStore.instance()
    schema = OmegaConf.structured(ExperimentConfig)
    schema.sampling = OmegaConf.structured(SamplingConfig)
    OmegaConf.set_readonly(schema.sampling, False)  # frozen in the library; presets merge into it
    store.store(name="experiment_schema", node=schema)
    if not drafter_presets:
        return
    from specdec import drafters

    for name in drafters.names():
        if not (CONF_DIR / "drafter" / f"{name}.yaml").exists():
            store.store(group="drafter", name=name, node=DrafterConfig(name=name))
