"""The target's features recomputed from token-shard rollout sets, as the training data `make_batch` reads.

Owns `token_sequences`, `recompute` and `token_features` (a disposable per-shard cache keyed by weights and shard
SHA-256, a few shards in memory at a time). Knows nothing about training.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import specdec
from specdec.training.prompts import prompt_text, shared_ngrams, user
from specdec.training.tokens import MANIFEST, ShardError, TokenSet, prompt_id, source_prompts, target_identity


@dataclass(frozen=True)
class TokenSequence:
    """One rolled-out sequence of a set."""

    tokens: torch.Tensor  # [L] long: chat-formatted prompt + the target's continuation.
    prompt_len: int  # Prompt tokens at the start.
    prompt_id: str  # specdec.training.tokens.prompt_id of its prompt.
    source: str  # Prompt source name.
    temperature: float  # 0 = greedy continuation.


def token_sequences(sets: list[TokenSet]) -> list[TokenSequence]:
    """Every sequence of `sets`, set by set, shard by shard (each shard verified as it is read)."""
    out = []
    for s in sets:
        for info in s.shards:
            for tokens, n, pid, src in zip(s.read(info), info.prompt_len, info.prompt_ids, info.sources):
                out.append(TokenSequence(tokens, n, pid, src, s.rollout["temperature"]))
    return out


def frozen_target(name: str, device: str, threads: int):
    """`name` loaded with the plain torch kernels on `device`, its weights frozen, torch at `threads` threads."""
    torch.set_num_threads(threads)
    target = specdec.load_target(name, device=device, kernel="torch", threads=threads)
    for p in target.model.parameters():
        p.requires_grad_(False)
    return target


def overlapping(seqs: list[TokenSequence], held: set[str], sets: list[TokenSet]) -> set[str]:
    """Ids of training prompts sharing an 8-word run with a validation prompt in `held`, texts found from the
    sets' sources (SystemExit when a prompt id is no longer among them)."""
    texts = {}
    for s in sets:
        sources = sorted({src for info in s.shards for src in info.sources})
        seed = s.manifest["prompts"].get("seed", 0)
        texts.update((prompt_id(p), prompt_text(p)) for _, p in source_prompts(sources, seed))
    lost = sorted({q.prompt_id for q in seqs} - set(texts))
    if lost:
        raise SystemExit(f"{len(lost)} prompt ids of {[str(s.root) for s in sets]} (e.g. {lost[0]}) are not in their "
                         "sources now: the prompt sources changed, the overlap with validation cannot be checked")
    train = sorted({q.prompt_id for q in seqs} - held)
    close = set(shared_ngrams([user(texts[i]) for i in train], [texts[i] for i in sorted(held)]))
    return {i for i in train if texts[i] in close}


def split_rows(seqs: list[TokenSequence], held: set[str], sets: list[TokenSet]) -> tuple[list[int], list[int], set[str]]:
    """(training rows, validation rows, dropped prompt ids): validation = the greedy sequences of the
    `held` prompts; training = every other sequence whose prompt shares no 8-word run with them."""
    near = overlapping(seqs, held, sets)
    train = [i for i, s in enumerate(seqs) if s.prompt_id not in held and s.prompt_id not in near]
    return train, [i for i, s in enumerate(seqs) if s.prompt_id in held and s.temperature == 0], near


@torch.no_grad()  # not inference_mode: the features become training inputs
def recompute(target, tokens: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final hidden states [L, H] float32, aux-layer states [L, kH] bf16 or None) of `tokens` [L]: the
    final states rollout_batch records (`last_hidden_state`; aux = HF `hidden_states` at `layers`)."""
    out = target.base(input_ids=tokens[None].to(target.device), output_hidden_states=bool(layers))
    hidden = out.last_hidden_state[0].float().cpu()
    aux = torch.cat([out.hidden_states[k] for k in layers], -1)[0].to(torch.bfloat16).cpu() if layers else None
    return hidden, aux


@torch.no_grad()
def recompute_batch(target, seqs: list[torch.Tensor], layers: tuple[int, ...] = ()
                    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`recompute` of several sequences in one right-padded forward (a GPU's way); causal attention keeps
    each sequence's states its own, up to rounding."""
    lengths = [len(t) for t in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(seqs):
        ids[i, : len(t)], mask[i, : len(t)] = t, 1
    out = target.base(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                      output_hidden_states=bool(layers))
    hidden = out.last_hidden_state.float().cpu()
    aux = torch.cat([out.hidden_states[k] for k in layers], -1).to(torch.bfloat16).cpu() if layers else None
    return [(hidden[i, :n], None if aux is None else aux[i, :n]) for i, n in enumerate(lengths)]


BATCH_ON_DEVICE = 32  # Sequences per recompute_batch forward on an accelerator (a CPU recomputes one at a time).


def check_target(sets: list[TokenSet], identity: dict) -> None:
    """ShardError naming the manifest of a set rolled out by another target than `identity`."""
    for s in sets:
        diff = {k: (s.target.get(k), identity.get(k)) for k in sorted(set(s.target) | set(identity))
                if s.target.get(k) != identity.get(k)}
        if diff:
            raise ShardError(f"{s.root / MANIFEST} names another target than the one given "
                             f"({{field: (manifest, given)}}: {diff}); its features cannot be recomputed with it")


def _cache_path(cache: Path, sha256: str, layers: tuple[int, ...]) -> Path:
    return cache / f"{sha256}-{'-'.join(map(str, layers)) or 'final'}.safetensors"


def _write_features(target, seqs: list[torch.Tensor], layers: tuple[int, ...], path: Path) -> None:
    """One shard's features (bf16) written atomically to its cache file `path`."""
    if target.device.type == "cpu":
        states = [recompute(target, tokens, layers) for tokens in seqs]
    else:
        states = [x for i in range(0, len(seqs), BATCH_ON_DEVICE)
                  for x in recompute_batch(target, seqs[i:i + BATCH_ON_DEVICE], layers)]
    tensors = {"hidden": torch.cat([h.to(torch.bfloat16) for h, _ in states])}
    if layers:
        tensors["aux"] = torch.cat([a for _, a in states])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


class _Column:
    """`hidden` or `aux` of a ShardedRollouts: row r read from its shard's cache file."""

    def __init__(self, owner: ShardedRollouts, key: str) -> None:
        self.owner, self.key = owner, key

    def __len__(self) -> int:
        return len(self.owner.sequences)

    def __getitem__(self, row: int) -> torch.Tensor:
        shard, k = self.owner.where[row]
        return self.owner.shard(shard)[self.key][k]


class ShardedRollouts:
    """What make_batch reads of a `Rollouts` (sequences, prompt_len, hidden[r], aux[r]), with the features left in the
    per-shard cache files and at most `resident` shards in memory (the least recently used is dropped)."""

    def __init__(self, sequences: list[torch.Tensor], prompt_len: list[int], temperature: list[float],
                 files: list[tuple[Path, list[int]]], has_aux: bool, resident: int = 16) -> None:
        self.sequences, self.prompt_len, self.temperature = sequences, prompt_len, temperature
        self.prompt_index = list(range(len(sequences)))
        self.files, self.resident = files, max(1, resident)
        self.where = [(i, k) for i, (_, lengths) in enumerate(files) for k in range(len(lengths))]
        self.hidden = _Column(self, "hidden")
        self.aux = _Column(self, "aux") if has_aux else []
        self._loaded: OrderedDict[int, dict[str, list[torch.Tensor]]] = OrderedDict()

    @property
    def num_tokens(self) -> int:
        return sum(s.numel() for s in self.sequences)

    def shard(self, i: int) -> dict[str, list[torch.Tensor]]:
        """Shard i's features split per sequence (loaded, or moved to most recently used)."""
        if i in self._loaded:
            self._loaded.move_to_end(i)
            return self._loaded[i]
        path, lengths = self.files[i]
        try:
            t = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise ShardError(f"feature cache file {path} cannot be read ({err}); delete it to compute it again") from err
        if t["hidden"].shape[0] != sum(lengths):
            raise ShardError(f"feature cache file {path} has {t['hidden'].shape[0]} rows, its shard {sum(lengths)} "
                             "tokens; delete it to compute it again")
        self._loaded[i] = {k: list(v.split(lengths)) for k, v in t.items()}
        while len(self._loaded) > self.resident:
            self._loaded.popitem(last=False)
        return self._loaded[i]


def token_features(target, sets: list[TokenSet], layers: tuple[int, ...], cache_dir: str | Path,
                   identity: dict | None = None, resident: int = 16) -> ShardedRollouts:
    """The sequences of `sets` (rows in `token_sequences` order) with the target's features as a ShardedRollouts:
    each shard's computed once into `cache_dir` (bf16), then read on demand. Every set must name this target."""
    identity = identity or target_identity(target)
    check_target(sets, identity)
    cache = Path(cache_dir) / identity["weights_sha256"][:16]
    sequences, prompt_len, temperature, files = [], [], [], []
    for s in sets:
        for index, info in enumerate(s.shards):
            path = _cache_path(cache, info.sha256, tuple(layers))
            if not path.exists():
                _write_features(target, s.read(info), tuple(layers), path)
            sequences += s.read(info)
            prompt_len += list(info.prompt_len)
            temperature += [s.rollout["temperature"]] * len(info.length)
            files.append((path, list(info.length)))
    if not files:
        raise ShardError(f"no recorded shards in {[str(s.root) for s in sets]}: roll out prompts first")
    return ShardedRollouts(sequences, prompt_len, temperature, files, bool(layers), resident)
