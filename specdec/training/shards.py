"""Rollout shards on disk: a folder of safetensors files plus a manifest with a checksum per shard.

Owns `ShardStore` and `read_union` (several stores' shards as one). Shard i holds the rollouts of
prompts [i * shard_prompts, (i + 1) * shard_prompts)
of a fixed prompt list, so a resumed run regenerates exactly the shards the manifest lacks (never a
second copy of a prompt range, never a gap). A shard is written to a temporary file, renamed into
place, and only then recorded in `manifest.json` (itself replaced atomically), so a crash leaves at
worst an unrecorded file that the next run overwrites. Reading verifies every recorded shard (size,
SHA-256, tensor layout) and names the file that is missing, truncated or corrupt. Knows nothing about
targets or training: it stores `Rollouts` (defined here) as flat tensors.

`AuxStore` keeps features derived from a store's shards (EAGLE-3's low/mid target layers, computed
afterwards by a prefill of each sequence) beside them in `<store>/aux-<layers>/`, one file per shard
with its own manifest, each entry recording the SHA-256 of the shard it was computed from, so a shard
and its aux file can never be paired wrongly, and a missing one is computed again, never twice.

Shard layout (S sequences, T tokens, hidden width H):
    tokens [T] int32         all sequences concatenated
    offsets [S + 1] int64    sequence s is tokens[offsets[s]:offsets[s + 1]]
    hidden [T, H]            the target's final hidden state at every token (bf16 by default)
    prompt_index [S] int64   index of each sequence's prompt in the prompt list
    prompt_len [S] int64     tokens of the chat-formatted prompt (the rest is the target's continuation)
    temperature [S] float32  0 = greedy continuation
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class Rollouts:
    """The target's own sequences and final hidden states (the head's training data)."""

    sequences: list[torch.Tensor]
    """Each [L] long: chat-formatted prompt + the target's continuation."""
    hidden: list[torch.Tensor]
    """Each [L, H]: the target's final hidden state at every position of its sequence."""
    prompt_index: list[int] = field(default_factory=list)
    """Index of each sequence's prompt in the prompt list."""
    prompt_len: list[int] = field(default_factory=list)
    """Prompt tokens at the start of each sequence."""
    temperature: list[float] = field(default_factory=list)
    """Temperature of each continuation (0 = greedy)."""
    aux: list[torch.Tensor] = field(default_factory=list)
    """Each [L, kH] (bf16): the target's hidden states of k aux layers per position; [] = none read."""

    @property
    def num_tokens(self) -> int:
        return sum(s.numel() for s in self.sequences)

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        return Rollouts(*(sum((getattr(p, f) for p in parts), []) for f in
                          ("sequences", "hidden", "prompt_index", "prompt_len", "temperature", "aux")))


class ShardError(ValueError):
    """A shard or manifest is missing, truncated, corrupt or from another configuration."""


@dataclass(frozen=True)
class ShardInfo:
    """One recorded shard (an entry of manifest.json)."""

    index: int
    """Shard number i: prompts [i * shard_prompts, (i + 1) * shard_prompts)."""
    file: str
    """File name inside the store folder."""
    bytes: int
    """File size in bytes."""
    sha256: str
    """SHA-256 of the file."""
    prompts_sha256: str
    """SHA-256 of the prompt texts this shard continues (detects a changed prompt list on resume)."""
    num_sequences: int
    """Sequences in the shard."""
    num_tokens: int
    """Tokens in the shard (prompt + continuation)."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def texts_sha256(texts: list[str]) -> str:
    return hashlib.sha256("\x1e".join(texts).encode()).hexdigest()


def _verify_file(what: str, path: Path, size: int, sha256: str, manifest: Path) -> Path:
    """`path` after checking it exists with the `size` and `sha256` that `manifest` records (ShardError naming it else)."""
    if not path.exists():
        raise ShardError(f"{what} {path} is recorded in {manifest} but missing")
    actual = path.stat().st_size
    if actual != size:
        raise ShardError(f"{what} {path} is truncated or altered: {actual} bytes, the manifest records {size}")
    if file_sha256(path) != sha256:
        raise ShardError(f"{what} {path} is corrupt: its SHA-256 differs from the manifest's")
    return path


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardStore:
    """A folder of rollout shards for one fingerprint (target, rollout settings, shard size).

    Opening an existing folder checks that its manifest's fingerprint equals `fingerprint` (else
    ShardError naming the manifest: data from another target or configuration is never mixed in).
    """

    def __init__(self, root: str | Path, fingerprint: dict) -> None:
        self.root = Path(root)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it will read back from JSON
        path = self.root / MANIFEST
        if path.exists():
            try:
                manifest = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ShardError(f"{path} is not valid JSON ({err}); delete the folder to start the data afresh") from err
            if manifest.get("format_version") != FORMAT_VERSION:
                raise ShardError(f"{path}: format_version {manifest.get('format_version')!r}, this specdec "
                                 f"reads {FORMAT_VERSION}")
            if manifest["fingerprint"] != self.fingerprint:
                diff = {k: (manifest["fingerprint"].get(k), self.fingerprint.get(k))
                        for k in set(manifest["fingerprint"]) | set(self.fingerprint)
                        if manifest["fingerprint"].get(k) != self.fingerprint.get(k)}
                raise ShardError(f"{path} was written for another configuration ({{key: (stored, now)}}: {diff}); "
                                 "use another data folder or the same settings")
            self.shards = {s["index"]: ShardInfo(**s) for s in manifest["shards"]}
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            self.shards = {}
            self._save_manifest()

    def _save_manifest(self) -> None:
        manifest = {"format_version": FORMAT_VERSION, "fingerprint": self.fingerprint,
                    "shards": [asdict(self.shards[i]) for i in sorted(self.shards)]}
        _write_atomic(self.root / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))

    def done(self) -> set[int]:
        """Indices of the recorded shards."""
        return set(self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards.values())

    def check_prompts(self, index: int, texts: list[str]) -> None:
        """ShardError if recorded shard `index` was made from other prompt texts than `texts`."""
        info = self.shards.get(index)
        if info is not None and info.prompts_sha256 != texts_sha256(texts):
            raise ShardError(f"{self.root / info.file} was generated from other prompts than shard {index}'s "
                             "prompts now; the prompt list changed: use a new data folder")

    def write(self, index: int, rollouts, prompt_texts: list[str], hidden_dtype: torch.dtype = torch.bfloat16) -> ShardInfo:
        """Write shard `index` (replacing an unrecorded file of that name) and record it."""
        if index in self.shards:
            raise ShardError(f"shard {index} is already recorded in {self.root / MANIFEST}; a run never writes it twice")
        lengths = [s.numel() for s in rollouts.sequences]
        offsets = torch.tensor([0] + lengths).cumsum(0)
        tensors = {
            "tokens": torch.cat(rollouts.sequences).to(torch.int32),
            "offsets": offsets,
            "hidden": torch.cat(rollouts.hidden).to(hidden_dtype).contiguous(),
            "prompt_index": torch.tensor(rollouts.prompt_index, dtype=torch.long),
            "prompt_len": torch.tensor(rollouts.prompt_len, dtype=torch.long),
            "temperature": torch.tensor(rollouts.temperature, dtype=torch.float32),
        }
        name = f"shard-{index:05d}.safetensors"
        _write_atomic(self.root / name, lambda p: save_file(tensors, str(p), metadata={"index": str(index)}))
        path = self.root / name
        info = ShardInfo(index=index, file=name, bytes=path.stat().st_size, sha256=file_sha256(path),
                         prompts_sha256=texts_sha256(prompt_texts), num_sequences=len(lengths),
                         num_tokens=int(offsets[-1]))
        self.shards[index] = info
        self._save_manifest()
        return info

    def verify(self, info: ShardInfo) -> Path:
        """The shard's path after checking it exists, has its recorded size and checksum (ShardError else)."""
        return _verify_file("shard", self.root / info.file, info.bytes, info.sha256, self.root / MANIFEST)

    def read(self, index: int):
        """The Rollouts of recorded shard `index` (hidden as float32), verified first."""
        info = self.shards[index]
        path = self.verify(info)
        try:
            t = load_file(str(path))
            offsets = t["offsets"].tolist()
            tokens, hidden = t["tokens"].long(), t["hidden"].float()
        except (SafetensorError, KeyError) as err:
            raise ShardError(f"shard {path} cannot be read: {err}") from err
        if len(offsets) != info.num_sequences + 1 or not offsets[-1] == tokens.numel() == hidden.shape[0]:
            raise ShardError(f"shard {path}: offsets, tokens and hidden disagree")
        return Rollouts(
            sequences=[tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
            hidden=[hidden[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
            prompt_index=t["prompt_index"].tolist(), prompt_len=t["prompt_len"].tolist(),
            temperature=t["temperature"].tolist(),
        )

    def read_all(self):
        """Every recorded shard, in index order, as one Rollouts (ShardError naming a bad shard)."""
        if not self.shards:
            raise ShardError(f"{self.root} holds no recorded shards: generate rollouts first")
        return Rollouts.concat([self.read(i) for i in sorted(self.shards)])


class AuxStore:
    """Per-shard aux features of `store` for target hidden-state indices `layers` (see the module docstring)."""

    def __init__(self, store: ShardStore, layers: tuple[int, ...]) -> None:
        if not layers:
            raise ValueError("an AuxStore needs at least one layer")
        self.store, self.layers = store, tuple(int(k) for k in layers)
        self.root = store.root / ("aux-" + "-".join(map(str, self.layers)))
        path = self.root / MANIFEST
        self.files: dict[int, dict] = {}
        if path.exists():
            try:
                manifest = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ShardError(f"{path} is not valid JSON ({err}); delete {self.root} to compute the aux features again") from err
            if tuple(manifest.get("layers", ())) != self.layers:
                raise ShardError(f"{path} records layers {manifest.get('layers')}, expected {list(self.layers)}")
            self.files = {int(k): v for k, v in manifest["files"].items()}

    def done(self) -> set[int]:
        """Shards of the store whose aux file is recorded and was computed from the shard as it is now."""
        return {i for i, v in self.files.items() if i in self.store.shards
                and v["shard_sha256"] == self.store.shards[i].sha256}

    def write(self, index: int, aux: torch.Tensor) -> None:
        """Write shard `index`'s aux features [T, kH] (T = the shard's tokens) and record them."""
        info = self.store.shards[index]
        if aux.shape[0] != info.num_tokens:
            raise ShardError(f"aux features for {self.store.root / info.file} have {aux.shape[0]} rows, "
                             f"the shard has {info.num_tokens} tokens")
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / info.file
        _write_atomic(path, lambda p: save_file({"aux": aux.to(torch.bfloat16).contiguous()}, str(p)))
        self.files[index] = {"file": info.file, "bytes": path.stat().st_size, "sha256": file_sha256(path),
                             "shard_sha256": info.sha256}
        manifest = {"layers": list(self.layers), "files": {str(i): self.files[i] for i in sorted(self.files)}}
        _write_atomic(self.root / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))

    def read(self, index: int) -> torch.Tensor:
        """Shard `index`'s aux features [T, kH] (bf16), verified (ShardError naming the file else)."""
        info = self.store.shards[index]
        entry = self.files.get(index)
        if entry is None or entry["shard_sha256"] != info.sha256:
            raise ShardError(f"{self.store.root / info.file} has no aux features for layers {list(self.layers)} in "
                             f"{self.root}: compute them (train_eagle.py stage=data with aux_layers set)")
        path = _verify_file("aux file", self.root / entry["file"], entry["bytes"], entry["sha256"], self.root / MANIFEST)
        try:
            aux = load_file(str(path))["aux"]
        except (SafetensorError, KeyError) as err:
            raise ShardError(f"aux file {path} cannot be read: {err}") from err
        if aux.shape[0] != info.num_tokens:
            raise ShardError(f"aux file {path} has {aux.shape[0]} rows, its shard {info.num_tokens} tokens")
        return aux


def read_union(stores: list[ShardStore], aux_layers: tuple[int, ...] = ()) -> Rollouts:
    """The shards of several stores over one prompt list (e.g. one per rollout worker), in store
    order, each shard index once, with their aux features of `aux_layers` when given; ShardError if
    two stores disagree on the prompts of an index, an aux file is missing or none records a shard."""
    seen: dict[int, tuple[ShardStore, ShardInfo]] = {}
    parts = []
    for store in stores:
        aux_store = AuxStore(store, aux_layers) if aux_layers else None
        for i in sorted(store.done()):
            info = store.shards[i]
            if i in seen:
                first, other = seen[i]
                if other.prompts_sha256 != info.prompts_sha256:
                    raise ShardError(f"{store.root / info.file} and {first.root / other.file} are both shard {i} "
                                     "but continue other prompts: the stores come from different prompt lists")
                continue
            seen[i] = (store, info)
            part = store.read(i)
            if aux_store is not None:
                aux = aux_store.read(i)
                part.aux = list(aux.split([s.numel() for s in part.sequences]))
            parts.append(part)
    if not parts:
        raise ShardError(f"no recorded shards in {[str(s.root) for s in stores]}: generate rollouts first")
    return Rollouts.concat(parts)
