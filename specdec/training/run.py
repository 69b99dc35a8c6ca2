"""One EAGLE training run, cut and resumed across machines and days, never restarted.

Owns `RunConfig`, `lr_factor` (warm-up, constant, cosine anneal: a function of the step alone), `validation_prompts`
and `Run` (everything the next step depends on, in one atomic checkpoint that `Run.resume` continues exactly).
Knows nothing about how data is made or read.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from specdec.drafters.eagle_head import EagleHead, HeadConfig
from specdec.machine import device_label
from specdec.training.eagle import Rollouts, acceptance_per_depth, depth_losses, make_batch, unroll
from specdec.training.tokens import ShardError

CHECKPOINT_FORMAT = "specdec-eagle-run-v1"
SCHEDULE_FIELDS = ("anneal_start", "max_steps")


@dataclass(frozen=True)
class RunConfig:
    """The settings one run keeps from its first step to its last."""

    lr: float = 3e-4  # Peak (constant-phase) AdamW learning rate.
    warmup_steps: int = 100  # Linear warm-up from lr / warmup_steps to lr.
    anneal_start: int = 10_000
    """Step where the constant phase ends and the cosine anneal begins (may grow on resume before it)."""
    max_steps: int = 12_000  # Step where the anneal reaches final_lr_fraction x lr and the run ends.
    final_lr_fraction: float = 0.0  # Learning rate at max_steps, as a fraction of lr.
    batch_size: int = 8  # Sequences per optimiser step.
    max_len: int = 384  # Training rows are cropped to this many tokens.
    ttt_depth: int = 6  # Training-time test depth (drafting's dynamic(8,6,32) drafts to depth 6).
    depth_decay: float = 1.0  # Weight of depth s is depth_decay ** (s - 1).
    ce_weight: float = 0.1  # Weight of the cross-entropy term (regression has weight 1).
    ce_vocab: int = 4096  # The cross-entropy runs over the head's first ce_vocab draft-vocabulary tokens.
    feature_noise: float = 0.2  # Width of the uniform noise on the depth-1 input features.
    generated_only: bool = True  # Loss only where the scored token is the target's continuation (as validation counts).
    weight_decay: float = 0.0  # AdamW weight decay.
    grad_clip: float = 0.5  # Gradient-norm clip.
    val_depth: int = 6  # Depths validation reports (chain(val_depth) MAL).
    eval_vocab: int = 4096  # Validation drafts over the head's first eval_vocab draft-vocabulary tokens.
    seed: int = 0  # Seed of the batch order and the feature noise.
    val_dtype: str = "float32"
    """Dtype of the head copy validation drafts with: 'bfloat16' scores what head_dtype='auto' drafts
    with where it picks bf16 (the trained weights stay float32)."""

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_steps <= self.anneal_start <= self.max_steps:
            raise ValueError(f"need 0 <= warmup_steps <= anneal_start <= max_steps, got {self.warmup_steps}, "
                             f"{self.anneal_start}, {self.max_steps}")
        if self.val_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"val_dtype must be float32, bfloat16 or float16, got {self.val_dtype!r}")
        if self.ttt_depth < 1 or self.batch_size < 1:
            raise ValueError(f"ttt_depth and batch_size must be >= 1, got {self.ttt_depth}, {self.batch_size}")


def lr_factor(step: int, cfg: RunConfig) -> float:
    """Learning rate of optimiser step `step` (0-based) as a fraction of cfg.lr. Example with
    warmup 10, anneal_start 100, max_steps 200, final 0: step 4 -> 0.5, steps 9..99 -> 1, step 150 -> 0.5."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if step < cfg.anneal_start:
        return warm
    span = max(cfg.max_steps - cfg.anneal_start, 1)
    t = min(step - cfg.anneal_start, span) / span
    return warm * (cfg.final_lr_fraction + (1 - cfg.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * t)))


def validation_prompts(prompt_ids: list[str], temperatures: list[float], n: int, seed: int = 0) -> list[str]:
    """The `n` prompt ids (among those with a greedy sequence) whose SHA-256 under `seed` is smallest:
    a choice that does not depend on the order or size of the data at hand."""
    greedy = sorted({p for p, t in zip(prompt_ids, temperatures) if t == 0})
    if len(greedy) < n:
        raise ValueError(f"validation needs {n} prompts with a greedy sequence, the data has {len(greedy)}")
    return sorted(greedy, key=lambda p: hashlib.sha256(f"{seed}:{p}".encode()).hexdigest())[:n]


class Run:
    """A head being trained, with everything its next step depends on."""

    def __init__(self, cfg: RunConfig, head: EagleHead, target, data_checksum: str, val_ids: list[str],
                 shards: list[list[str]] | None = None) -> None:
        self.device = target.device  # the head trains where the target runs (a CPU or a GPU; one state file)
        self.cfg, self.head, self.target = cfg, head.float().to(self.device).train(), target
        self.data_checksum, self.val_ids = data_checksum, list(val_ids)
        self.shards = shards  # per rollout set, its shards' SHA-256 in order (what `grow` compares)
        self.data_history: list[dict] = []  # {"step", "from", "to"} for every resume on grown sets
        self.embed = target.base.get_input_embeddings()
        lm_weight = target.lm_head.weight.detach().float()  # [V, H]
        self.ce_rows = lm_weight[head.draft_vocab[: cfg.ce_vocab].to(self.device)]  # [N, H]
        self.eval_vocab = head.draft_vocab[: cfg.eval_vocab].to(self.device)
        self.eval_rows = lm_weight[self.eval_vocab]
        self.opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr * lr_factor(0, cfg), betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.step, self.order, self.best = 0, [], None
        self.window: dict[str, float] = {}  # sums of loss and train top-1 since the last curve point

    def train_step(self, data: Rollouts, rows: list[int]) -> dict[str, float]:
        """One optimiser step on the next batch of `rows` (indices of `data`; a fresh permutation of
        them, drawn from the run's generator, whenever the last one is used up)."""
        cfg = self.cfg
        if not self.order:
            self.order = [rows[i] for i in torch.randperm(len(rows), generator=self.generator).tolist()]
        batch_rows, self.order = self.order[: cfg.batch_size], self.order[cfg.batch_size:]
        batch = make_batch(data, batch_rows, cfg.max_len, self.device)
        for group in self.opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(self.step, cfg)
        predicted = unroll(self.head, self.embed, batch, cfg.ttt_depth, cfg.feature_noise, self.generator)
        loss, parts = depth_losses(predicted, batch, self.ce_rows, ce_weight=cfg.ce_weight, depth_decay=cfg.depth_decay,
                                   generated_only=cfg.generated_only)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        record = {"loss": loss.item(), **parts}
        for k, v in record.items():
            self.window[k] = self.window.get(k, 0.0) + v
        self.window["steps"] = self.window.get("steps", 0) + 1
        return record

    @torch.no_grad()
    def validate(self, batches) -> dict[str, float]:
        """Greedy chain acceptance per depth on validation batches (specdec.training.eagle.acceptance_per_depth)."""
        dtype = getattr(torch, self.cfg.val_dtype)
        head = self.head if dtype == torch.float32 else copy.deepcopy(self.head).to(dtype)
        head.eval()
        stats = acceptance_per_depth(head, self.embed, self.eval_rows, self.eval_vocab, batches, self.cfg.val_depth)
        self.head.train()
        return stats

    def curve_point(self, val: dict | None) -> dict:
        """The curve's record for this step (train means since the last point, validation, lr), resetting the window."""
        steps = self.window.pop("steps", 0)
        point = {"step": self.step, "lr": self.cfg.lr * lr_factor(max(self.step - 1, 0), self.cfg),
                 "train": {k: v / steps for k, v in self.window.items()} if steps else {},
                 "val": val, "data_checksum": self.data_checksum[:16], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "device": device_label(self.device)}
        self.window = {}
        if val is not None and (self.best is None or val["chain_mal"] > self.best["chain_mal"]):
            self.best = {"step": self.step, **val}
        return point

    def state(self) -> dict:
        return {"format": CHECKPOINT_FORMAT, "config": asdict(self.cfg), "head_config": asdict(self.head.config),
                "head": self.head.state_dict(), "draft_vocab": self.head.draft_vocab.clone(),
                "opt": self.opt.state_dict(), "generator": self.generator.get_state(), "step": self.step,
                "order": list(self.order), "best": self.best, "window": dict(self.window),
                "data_checksum": self.data_checksum, "val_ids": list(self.val_ids), "shards": self.shards,
                "data_history": list(self.data_history)}

    def save(self, path: str | Path, compact: bool = False) -> Path:
        """Write the run's whole state to `path` (atomically: a cut mid-write leaves the previous one);
        `compact`: the repository's copy (see the module docstring)."""
        path = Path(path)
        state = self.state()
        if compact:
            state["head"] = {k: v.to(torch.bfloat16) if v.dim() > 1 else v for k, v in state["head"].items()}
            state["opt"]["state"] = {k: {n: t if n == "step" else t.to(torch.bfloat16) for n, t in v.items()}
                                     for k, v in state["opt"]["state"].items()}
            state["compact"] = True
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    @staticmethod
    def saved_step(path: str | Path) -> int:
        """The step of the run saved at `path` (-1 when there is no file)."""
        path = Path(path)
        return torch.load(path, weights_only=False, map_location="cpu")["step"] if path.exists() else -1

    @classmethod
    def resume(cls, path: str | Path, target, cfg: RunConfig, data_checksum: str, expected: HeadConfig,
               shards: list[list[str]] | None = None, grow: bool = False, fork: bool = False) -> Run:
        """The run saved at `path`, checked against `cfg`, the head geometry and the data (ShardError / ValueError
        naming `path`); `grow` accepts sets that only gained shards, `fork` starts another run with other settings."""
        path = Path(path)
        state = torch.load(path, weights_only=False, map_location="cpu")
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is not an EAGLE run checkpoint (format {state.get('format')!r})")
        head_config = HeadConfig(**{**state["head_config"], "aux_layers": tuple(state["head_config"]["aux_layers"])})
        head_config.check_same_geometry(expected, path)
        saved = RunConfig(**state["config"])
        changed = {f.name: (getattr(saved, f.name), getattr(cfg, f.name)) for f in fields(RunConfig)
                   if getattr(saved, f.name) != getattr(cfg, f.name)}
        other = {k: v for k, v in changed.items() if k not in SCHEDULE_FIELDS}
        if other and not fork:
            raise ValueError(f"{path} was trained with other settings ({{field: (saved, now)}}: {other}); "
                             "only anneal_start and max_steps may change on resume")
        if changed and not fork and state["step"] > min(saved.anneal_start, cfg.anneal_start):
            raise ValueError(f"{path} is at step {state['step']}, past anneal_start ({saved.anneal_start} saved, "
                             f"{cfg.anneal_start} now): the schedule's length can no longer change")
        grown = state["data_checksum"] != data_checksum
        if grown and not (grow and _extends(state.get("shards"), shards)):
            raise ShardError(f"{path} trained on shard set {state['data_checksum'][:16]}, the data now has checksum "
                             f"{data_checksum[:16]}: the shard set changed underneath the run; resume on the same "
                             "shards, or pass grow when the sets only gained shards (appended, none changed)")
        if state.get("compact"):
            state["head"] = {k: v.float() for k, v in state["head"].items()}
            state["opt"]["state"] = {k: {n: t if n == "step" else t.float() for n, t in v.items()}
                                     for k, v in state["opt"]["state"].items()}
        head = EagleHead(head_config, draft_vocab=state["draft_vocab"].cpu())
        head.load_state_dict(state["head"])
        run = cls(replace(cfg), head, target, data_checksum, state["val_ids"], shards)
        run.data_history = state.get("data_history", [])
        if fork:
            run.data_history.append({"step": state["step"], "forked_from": str(path), "changed": other})
        if grown:
            run.data_history.append({"step": state["step"], "from": state["data_checksum"], "to": data_checksum})
        run.opt.load_state_dict(state["opt"])
        run.generator.set_state(state["generator"])
        run.step, run.order, run.best, run.window = state["step"], state["order"], state["best"], state["window"]
        return run


def _extends(old: list[list[str]] | None, new: list[list[str]] | None) -> bool:
    """Whether every set of `new` starts with its shards in `old` (same sets, in the same order)."""
    return (old is not None and new is not None and len(old) == len(new)
            and all(n[:len(o)] == o for o, n in zip(old, new)))


def append_curve(path: str | Path, point: dict) -> None:
    """Append one curve point (a JSON line) to `path`."""
    with open(path, "a") as f:
        f.write(json.dumps(point) + "\n")


def trim_curve(path: str | Path, step: int) -> None:
    """Drop the points of `path` past `step` (written after the checkpoint a resumed run starts from)."""
    path = Path(path)
    if path.exists():
        kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in kept))


def advance(run: Run, data: Rollouts, rows: list[int], val_batches, *, until: int, val_every: int,
            checkpoint: str | Path, curve: str | Path, deadline: float = float("inf"), on_best=None) -> bool:
    """Train `run` on `rows` of `data` up to step `until`: every `val_every` steps and at max_steps validate, append the
    curve point and save; at `until` or past `deadline` save and stop. Returns whether `until` was reached."""
    while run.step < until:
        run.train_step(data, rows)
        if run.step % val_every == 0 or run.step == run.cfg.max_steps:
            append_curve(curve, run.curve_point(run.validate(val_batches)))
            if on_best is not None and run.best["step"] == run.step:
                on_best(run)
            run.save(checkpoint)
        elif run.step == until or time.time() > deadline:
            run.save(checkpoint)
        if run.step < until and time.time() > deadline:
            return False
    return True
