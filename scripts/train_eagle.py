"""Train an EAGLE head for a target by self-distillation (Hydra, strict structured config).

    python scripts/train_eagle.py                                   # data, then training (defaults)
    python scripts/train_eagle.py stage=data data_max_minutes=120   # only rollouts (resumable)
    python scripts/train_eagle.py stage=train resume=true           # continue training from out_dir/last
    python scripts/train_eagle.py device=cuda gen_batch_size=256    # the same on a GPU
    python scripts/train_eagle.py 'aux_layers=[3,15]' init_head=PLAIN_HEAD   # EAGLE-3 fusion, from a plain head
    python scripts/train_eagle.py stage=train 'extra_data_dirs=[outputs/old-data]'  # train on another run's data too
    python scripts/train_eagle.py 'sources=[chat:64,stdlib:16]' num_validation=8 shard_prompts=16 \\
        gen_batch_size=16 max_new_tokens=32 max_steps=20 val_every=10 out_dir=outputs/eagle-smoke   # smoke

Stages. (1) Prompts: the named sources of specdec/training/prompts (plus, with
`self_instruct=N`, questions the target writes itself), checked against every evaluation suite in
experiments/prompts/ (an 8-word overlap is an error) and split into training and validation prompts
(checked disjoint). (2) Rollouts: the target's own continuations (greedy; every n-th shard sampled)
in batches, written as checksummed shards under `data_dir/{train,val}` (specdec/training/shards.py);
a rerun generates only the shards the manifest lacks, and training uses whatever is recorded (partial
data is fine); with `aux_layers`, the target's hidden states after those layers are recorded with each
new shard from the rollout's own forwards, and computed for any recorded shard that lacks them (a
prefill per sequence), in `<store>/aux-<layers>/`, resumable the same way. (3) Training: EAGLE's
loss per depth over the head's own multi-step predictions (`ttt_depth`; 1 = the plain EAGLE
objective), optionally truncated after the first wrong depth (`truncate`); validation acceptance per
depth every `val_every` steps (in the progress bar and `train_log.jsonl`); the best head by validation
chain MAL is `out_dir/head-best`, the latest state `out_dir/last` (+ `last.state.pt`), from which
`resume=true` continues. The resolved config is saved beside the results.

This is the older pipeline (rounds 2-10: shards with hidden states outside the repository, a fresh
schedule per round). The one run that accumulates data and is never restarted uses token-shard
rollout sets in the repository (scripts/eagle_rollouts.py, data/eagle/) and
scripts/train_eagle_run.py (specdec/training/run.py).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from tqdm import tqdm

import specdec
from specdec.drafters.eagle import HEADS_DIR
from specdec.drafters.eagle_head import EagleHead, HeadConfig, rank_vocabulary, widen
from specdec.training.shards import AuxStore, Rollouts, ShardError, ShardStore, read_union
from specdec.training.eagle import (acceptance_per_depth, depth_losses, fill_aux, fill_shards, make_batch,
                                             self_instruct, unroll)
from specdec.training.prompts import check_disjoint, collect, prompt_text, shared_ngrams, split
from specdec.training.prompts.chat import TOPICS

ROOT = Path(__file__).resolve().parents[1]
EVAL_SUITES = ROOT / "experiments" / "prompts"


@dataclass(frozen=True)
class TrainConfig:
    """How to build the data and train one EAGLE head."""

    target: str = "smollm2-135m"
    """Target to distil (a specdec.load_target name or path)."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda[:n]': rollouts and training run there."""
    threads: int = 1
    """torch CPU threads."""
    stage: str = "all"
    """'data' (prompts + rollouts only), 'train' (train on the recorded shards only) or 'all'."""
    sources: list[str] = field(default_factory=lambda: ["chat:20000", "stdlib:200"])
    """Prompt sources as 'name:count' (names from specdec.training.prompts.SOURCES)."""
    self_instruct: int = 0
    """Questions the target writes on chat topics, added to the prompts (0 = none; kept in data_dir)."""
    num_validation: int = 64
    """Prompts held out as the validation split (greedy rollouts; acceptance per depth, checkpoint choice)."""
    seed: int = 0
    """Seed for prompts, split, sampling, init and batch order."""
    max_new_tokens: int = 160
    """Length limit of each target continuation."""
    gen_batch_size: int = 32
    """Prompts per batched rollout forward."""
    shard_prompts: int = 64
    """Prompts per shard (the unit of resumption)."""
    sampled_fraction: float = 0.25
    """Fraction of training shards continued by sampling at `temperature` (the rest greedily)."""
    temperature: float = 0.7
    """Temperature of the sampled continuations."""
    hidden_dtype: str = "bfloat16"
    """Dtype of the stored hidden states ('bfloat16' halves disk and memory; 'float32')."""
    data_max_minutes: float = 30.0
    """Stop generating rollouts (after a whole shard) once this much time has passed in this run."""
    data_dir: str = ""
    """Where the shards go ('' = out_dir/data)."""
    workers: int = 1
    """Rollout processes sharing data_dir (stage=data): worker k of n writes training shards i with
    i % n == k into data_dir/train-w{k}of{n} (n = 1: data_dir/train); only worker 0 writes the
    validation split. stage=train reads every data_dir/train* store (a shard index twice: once)."""
    worker: int = 0
    """This process's k in 0..workers-1."""
    first_shard: int = 0
    """stage=data writes only training shards with index >= this (the earlier ones of the same prompt
    list were written, and trained on, by a run whose data is gone: a rerun would replay them)."""
    extra_data_dirs: list[str] = field(default_factory=list)
    """stage=train also trains on the training stores of these data directories: rollouts of the same
    target from other prompt lists or rollout settings (seed, sampled_fraction, temperature, lengths,
    shard size; each store is read as its manifest records them), e.g. an earlier run's data, or sampled
    continuations of prompts another directory holds greedily. Validation stays data_dir's. Shards are
    de-duplicated within a directory, never across."""
    init_head: str = ""
    """Start from this head (.safetensors) instead of a random initialisation ('' = random)."""
    resume: bool = False
    """Continue from out_dir/last.{safetensors,state.pt} when present."""
    aux_layers: list[int] = field(default_factory=list)
    """EAGLE-3 fusion: target hidden-state indices (k = after decoder layer k) the head reads besides
    the final one, e.g. [3, 15]; [] = the final hidden state only. A plain init_head is widened
    (the new inputs start at zero weight)."""
    ttt_depth: int = 1
    """Training-time test depth: losses on the head's own predictions for depths 1..ttt_depth (1 = plain EAGLE)."""
    depth_decay: float = 1.0
    """Weight of depth s is depth_decay ** (s - 1)."""
    truncate: bool = False
    """Count a position at depth s only if the head's top token was right at depths 1..s-1 (Spec-AUF)."""
    ce_weight: float = 0.1
    """Weight of the cross-entropy term (EAGLE uses 0.1; regression has weight 1)."""
    feature_noise: float = 0.2
    """Width of the uniform noise added to the depth-1 input features (EAGLE's robustness trick)."""
    draft_vocab_size: int = 8192
    """Draft vocabulary stored with the head: the N most frequent target tokens of the training data
    (from init_head, its own ranking follows for tokens the data lacks)."""
    ce_vocab: int = 8192
    """The cross-entropy runs over the head's first ce_vocab draft-vocabulary tokens."""
    eval_vocab: int = 4096
    """Validation drafts over the head's first eval_vocab draft-vocabulary tokens (drafting's 'auto')."""
    val_depth: int = 6
    """Depths reported by validation (chain MAL of chain(val_depth))."""
    max_len: int = 384
    """Training rows are cropped to this many tokens."""
    batch_size: int = 8
    """Sequences per optimiser step."""
    max_steps: int = 2000
    """Optimiser steps in total (the cosine schedule's length)."""
    lr: float = 5e-4
    """Peak AdamW learning rate (linear warm-up, cosine decay to 0 at max_steps)."""
    warmup_steps: int = 20
    """Warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Gradient-norm clip."""
    val_every: int = 100
    """Validate (and checkpoint) every this many steps."""
    max_minutes: float = 55.0
    """Stop training (after a validation and checkpoint) once this much time has passed in this run."""
    out_dir: str = "outputs/eagle"
    """Where checkpoints, logs and the resolved config go."""
    ship: bool = False
    """Copy the best head into specdec/drafters/heads/<target>.{safetensors,json}."""


def _schema():
    """TrainConfig as a strict (struct) schema that Hydra may override; to_object returns the frozen dataclass."""
    node = OmegaConf.structured(TrainConfig)
    OmegaConf.set_readonly(node, False)
    return node


ConfigStore.instance().store(name="train_eagle", node=_schema())


def eval_texts() -> list[str]:
    """Every turn of every evaluation suite (experiments/prompts/*.jsonl)."""
    suites = sorted(EVAL_SUITES.glob("*.jsonl"))
    if not suites:
        raise FileNotFoundError(f"no evaluation suites under {EVAL_SUITES}: the disjointness check cannot run")
    return [turn for f in suites for line in f.read_text().splitlines() if line.strip()
            for turn in json.loads(line)["turns"]]


def parse_sources(items: list[str]) -> dict[str, int]:
    """['chat:100', 'stdlib:20'] -> {'chat': 100, 'stdlib': 20}; ValueError on another form."""
    counts = {}
    for item in items:
        name, _, count = str(item).rpartition(":")
        if not name or not count.isdigit():
            raise ValueError(f"prompt source {item!r} must read 'name:count', e.g. 'chat:1000'")
        counts[name] = int(count)
    return counts


def make_prompts(cfg: TrainConfig, target, data_dir: Path):
    """(train, validation) prompts: sources + self-instruct, checked against the evaluation suites."""
    prompts = collect(parse_sources(cfg.sources), cfg.seed)
    banned = eval_texts()
    if cfg.self_instruct:
        path = data_dir / "self_instruct.json"
        if path.exists():
            written = [tuple(p) for p in json.loads(path.read_text())]
        else:
            written = self_instruct(target, TOPICS, cfg.self_instruct, seed=cfg.seed)
            close = set(shared_ngrams(written, banned))
            written = [p for p in written if prompt_text(p) not in close]  # the target may echo a common phrase
            path.write_text(json.dumps(written, indent=1) + "\n")
        print(f"self-instruct: {len(written)} prompts ({path})", flush=True)
        prompts = prompts + written
    check_disjoint(prompts, [({"content": t},) for t in banned], what=f"evaluation suites in {EVAL_SUITES}")
    return split(prompts, cfg.num_validation, cfg.seed)


def fingerprint(cfg: TrainConfig, target) -> dict:
    return {"target": target.label, "max_new_tokens": cfg.max_new_tokens, "shard_prompts": cfg.shard_prompts,
            "sampled_fraction": cfg.sampled_fraction, "temperature": cfg.temperature, "seed": cfg.seed,
            "hidden_dtype": cfg.hidden_dtype, "hidden_size": target.hidden_size}


def train_store_name(cfg: TrainConfig) -> str:
    return "train" if cfg.workers == 1 else f"train-w{cfg.worker}of{cfg.workers}"


def train_stores(cfg: TrainConfig, target, data_dir: Path, *, as_recorded: bool = False) -> list[ShardStore]:
    """Every training store under data_dir (train, train-w*of*), each checked against this configuration;
    `as_recorded` (extra_data_dirs): opened with the rollout settings its manifest records, checked only
    for this target (ShardError naming the manifest of one that holds another target's data)."""
    ours = {**fingerprint(cfg, target), "split": "train"}
    stores = []
    for d in sorted(data_dir.glob("train*")):
        manifest = d / "manifest.json"
        if not manifest.exists():
            continue
        recorded = json.loads(manifest.read_text()).get("fingerprint", {}) if as_recorded else ours
        mismatch = {k: (recorded.get(k), ours[k]) for k in ("target", "hidden_size", "split")
                    if recorded.get(k) != ours[k]}
        if mismatch:
            raise ShardError(f"{manifest} holds rollouts of another target ({{key: (stored, now)}}: {mismatch})")
        stores.append(ShardStore(d, recorded))
    return stores


def check_unseen(val: Rollouts, train: Rollouts, where: list[str]) -> None:
    """ValueError when a training sequence continues a validation prompt (same prompt tokens): an extra
    data directory made from another prompt list, or another split of the same one, can hold them."""
    prompts = {tuple(s[:n].tolist()) for s, n in zip(val.sequences, val.prompt_len)}
    seen = sum(tuple(s[:n].tolist()) in prompts for s, n in zip(train.sequences, train.prompt_len))
    if seen:
        raise ValueError(f"{seen} training sequences continue validation prompts (validation {where[0]}, training "
                         f"{', '.join(where[1:])}): validation would score seen data; use disjoint prompt lists")


def load_head(cfg: TrainConfig, target, vocab: torch.Tensor, out: Path) -> tuple[EagleHead, dict | None]:
    """The head to train and the saved training state (resume), or (fresh head, None)."""
    expected = HeadConfig.for_target(target, aux_layers=tuple(cfg.aux_layers))
    last = out / "last.safetensors"
    if cfg.resume and last.exists():
        state_path = out / "last.state.pt"
        if not state_path.exists():
            raise FileNotFoundError(f"{last} exists but its training state {state_path} is missing")
        head = EagleHead.load(last)
        head.config.check_same_geometry(expected, last)
        return head, torch.load(state_path, weights_only=False)
    if cfg.init_head:
        path = Path(hydra.utils.to_absolute_path(cfg.init_head))
        head = EagleHead.load(path)
        if expected.aux_layers and not head.config.aux_layers:
            head = widen(head, expected.aux_layers)
        head.config.check_same_geometry(expected, path)
        old = head.draft_vocab[~torch.isin(head.draft_vocab, vocab)]
        vocab = torch.cat([vocab, old])[: cfg.draft_vocab_size]
    else:
        head = EagleHead(expected)
    head.draft_vocab = vocab
    return head, None


def save_checkpoint(head: EagleHead, path: Path) -> None:
    head.save(path, dtype=torch.float32)


@hydra.main(version_base="1.3", config_path=None, config_name="train_eagle")
def main(raw) -> None:
    cfg: TrainConfig = OmegaConf.to_object(raw)
    if cfg.stage not in ("all", "data", "train"):
        raise ValueError(f"stage must be 'all', 'data' or 'train', got {cfg.stage!r}")
    if cfg.ttt_depth < 1 or cfg.val_depth < 1:
        raise ValueError(f"ttt_depth and val_depth must be >= 1, got {cfg.ttt_depth} and {cfg.val_depth}")
    if cfg.first_shard < 0:
        raise ValueError(f"first_shard must be >= 0, got {cfg.first_shard}")
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available()
                          else "cpu" if cfg.device == "auto" else cfg.device)
    out = Path(hydra.utils.to_absolute_path(cfg.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**asdict(cfg), "resolved_device": str(device)}, indent=2) + "\n")
    data_dir = Path(hydra.utils.to_absolute_path(cfg.data_dir)) if cfg.data_dir else out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)

    target = specdec.load_target(cfg.target, device=device)
    for p in target.model.parameters():
        p.requires_grad_(False)
    if not 0 <= cfg.worker < cfg.workers:
        raise ValueError(f"worker must be in 0..workers-1, got worker={cfg.worker}, workers={cfg.workers}")
    val_store = ShardStore(data_dir / "val", {**fingerprint(cfg, target), "split": "val", "sampled_fraction": 0.0})
    backfilled = 0  # shards whose aux features needed fill_aux's separate prefill pass
    if cfg.stage in ("all", "data"):
        train_store = ShardStore(data_dir / train_store_name(cfg), {**fingerprint(cfg, target), "split": "train"})
        others = set().union(*(s.done() for s in train_stores(cfg, target, data_dir) if s.root != train_store.root))
        train_prompts, val_prompts = make_prompts(cfg, target, data_dir)
        print(f"prompts: {len(train_prompts)} train, {len(val_prompts)} validation", flush=True)
        deadline = started + 60 * cfg.data_max_minutes
        common = dict(shard_prompts=cfg.shard_prompts, batch_size=cfg.gen_batch_size, max_new_tokens=cfg.max_new_tokens,
                      temperature=cfg.temperature, seed=cfg.seed, hidden_dtype=getattr(torch, cfg.hidden_dtype))
        layers = tuple(cfg.aux_layers)
        if layers:
            HeadConfig.for_target(target, aux_layers=layers).check_target(target)
        val_aux, train_aux = (AuxStore(val_store, layers), AuxStore(train_store, layers)) if layers else (None, None)
        if cfg.worker == 0:
            fill_shards(target, val_store, val_prompts, sampled_fraction=0.0, desc="val rollouts", aux_store=val_aux,
                        **common)
        fill_shards(target, train_store, train_prompts, sampled_fraction=cfg.sampled_fraction, deadline=deadline,
                    worker=(cfg.worker, cfg.workers), skip=others | set(range(cfg.first_shard)), desc="train rollouts",
                    aux_store=train_aux,
                    **common)
        if layers:  # shards recorded before aux_layers was set (or whose aux write was interrupted)
            if cfg.worker == 0:
                backfilled += fill_aux(target, val_aux, desc="val aux features")
            backfilled += fill_aux(target, train_aux, desc="train aux features")
    data_minutes = (time.perf_counter() - started) / 60
    if cfg.stage == "data":
        print(json.dumps({"train_tokens": train_store.num_tokens, "val_tokens": val_store.num_tokens,
                          "aux_backfilled_shards": backfilled, "minutes": round(data_minutes, 1)}), flush=True)
        return
    layers = tuple(cfg.aux_layers)
    data_dirs = [data_dir] + [Path(hydra.utils.to_absolute_path(d)) for d in cfg.extra_data_dirs]
    stores = {d: train_stores(cfg, target, d, as_recorded=d != data_dir) for d in data_dirs}
    missing = [str(d) for d in data_dirs[1:] if not stores[d]]
    if missing:
        raise FileNotFoundError(f"extra_data_dirs {missing} hold no training store (train*/manifest.json)")
    data = Rollouts.concat([read_union(stores[d], layers) for d in data_dirs])
    val = read_union([val_store], layers)
    check_unseen(val, data, [str(val_store.root)] + [str(d) for d in data_dirs])
    print(f"data: {len(data.sequences)} train sequences ({data.num_tokens} tokens), {len(val.sequences)} validation "
          f"({val.num_tokens} tokens)", flush=True)

    torch.manual_seed(cfg.seed)
    vocab = rank_vocabulary(torch.cat(data.sequences), target.vocab_size)[: cfg.draft_vocab_size]
    head, state = load_head(cfg, target, vocab, out)
    head = head.float().to(device).train()
    embed = target.base.get_input_embeddings()
    lm_weight = target.lm_head.weight.detach().float()  # [V, H]
    ce_weight_rows = lm_weight[head.draft_vocab[: cfg.ce_vocab].to(device)]  # [N, H] the CE's vocabulary
    eval_vocab = head.draft_vocab[: cfg.eval_vocab].to(device)
    eval_rows = lm_weight[eval_vocab]
    val_batches = [make_batch(val, list(range(s, min(len(val.sequences), s + cfg.batch_size))), cfg.max_len, device)
                   for s in range(0, len(val.sequences), cfg.batch_size)]
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                                 * 0.5 * (1 + math.cos(math.pi * min(s, cfg.max_steps) / cfg.max_steps)))
    gen = torch.Generator().manual_seed(cfg.seed)
    step, best, order = 0, None, []
    if state is not None:
        opt.load_state_dict(state["opt"])
        schedule.load_state_dict(state["schedule"])
        gen.set_state(state["generator"])
        step, best, order = state["step"], state["best"], state["order"]
        print(f"resumed from {out / 'last.safetensors'} at step {step}", flush=True)

    def validate() -> dict:
        head.eval()
        stats = acceptance_per_depth(head, embed, eval_rows, eval_vocab, val_batches, cfg.val_depth)
        head.train()
        return stats

    log = open(out / "train_log.jsonl", "a")
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step")
    if step == 0:
        stats = validate()
        log.write(json.dumps({"step": 0, "val": stats}) + "\n")
        print(f"validation at step 0: {stats}", flush=True)
        best = {"step": 0, **stats}
        save_checkpoint(head, out / "head-best")
    while step < cfg.max_steps:
        if not order:
            order = torch.randperm(len(data.sequences), generator=gen).tolist()
        rows, order = order[: cfg.batch_size], order[cfg.batch_size:]
        batch = make_batch(data, rows, cfg.max_len, device)
        predicted = unroll(head, embed, batch, cfg.ttt_depth, cfg.feature_noise, gen)
        loss, parts = depth_losses(predicted, batch, ce_weight_rows, ce_weight=cfg.ce_weight,
                                   depth_decay=cfg.depth_decay, truncate=cfg.truncate)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        schedule.step()
        step += 1
        bar.update(1)
        record = {"step": step, "loss": loss.item(), **parts}
        out_of_time = (time.perf_counter() - started) / 60 > cfg.max_minutes
        if step % cfg.val_every == 0 or step == cfg.max_steps or out_of_time:
            stats = validate()
            record["val"] = stats
            if stats["chain_mal"] > best["chain_mal"]:
                best = {"step": step, **stats}
                save_checkpoint(head, out / "head-best")
            save_checkpoint(head, out / "last")
            torch.save({"step": step, "best": best, "order": order, "opt": opt.state_dict(),
                        "schedule": schedule.state_dict(), "generator": gen.get_state()}, out / "last.state.pt")
        bar.set_postfix(loss=f"{record['loss']:.3f}", **{k: f"{v:.2f}" for k, v in (record.get("val") or best).items()
                                                      if k.startswith("acc@") or k == "chain_mal"})
        log.write(json.dumps(record) + "\n")
        log.flush()
        if out_of_time:
            print(f"stopping at step {step}: max_minutes={cfg.max_minutes} reached (resume=true continues)", flush=True)
            break
    bar.close()
    summary = {"train_sequences": len(data.sequences), "train_tokens": data.num_tokens, "val_tokens": val.num_tokens,
               "aux_backfilled_shards": backfilled, "data_minutes": round(data_minutes, 1),
               "total_minutes": round((time.perf_counter() - started) / 60, 1), "steps": step, "best": best}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    if cfg.ship:
        best_head = EagleHead.load(out / "head-best")
        shipped = best_head.save(HEADS_DIR / cfg.target)  # bf16, as shipped heads are
        print(f"shipped {out / 'head-best'} to {shipped}", flush=True)


if __name__ == "__main__":
    main()
