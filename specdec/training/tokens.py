"""Rollouts kept as token ids only: a rollout set is a folder of raw uint16 shards plus one manifest.

Owns `TokenSet` (open, verify, append, read), `source_prompts`, `target_identity`, `prompt_id` (the unit of
resumption), `fill_token_set` and `set_checksum`. A shard is renamed into place before the manifest records it, so a
killed run loses at most one shard; one writer at a time. Knows nothing about features or training.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.training.prompts import Prompt

FORMAT = "specdec-eagle-token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LOCK = "write.lock"
TOKEN_DTYPE = np.dtype("<u2")  # vocabularies up to 65,536 tokens


class ShardError(ValueError):
    """A shard or manifest is missing, truncated, corrupt or from another configuration."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomic(path: Path, write) -> None:
    """`write(tmp)` to a temporary name beside `path`, synced, then renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)

@dataclass(frozen=True)
class TokenShard:
    """One recorded shard (an entry of manifest.json `shards`)."""

    index: int  # Shard number, in the order the shards were written.
    file: str  # File name inside the set folder.
    bytes: int  # File size: 2 x the shard's tokens.
    sha256: str  # SHA-256 of the file.
    prompt_ids: list[str]  # `prompt_id` of each sequence's prompt.
    sources: list[str]  # Prompt source of each sequence (a specdec.training.prompts source name).
    prompt_len: list[int]  # Tokens of each sequence's chat-formatted prompt (the rest is the target's continuation).
    length: list[int]  # Tokens of each sequence (prompt + continuation).

    @property
    def num_tokens(self) -> int:
        return sum(self.length)


def prompt_id(prompt: Prompt | str) -> str:
    """A prompt's content hash (16 hex digits of the SHA-256 of its turns as JSON): the same text in
    any source, order or run has the same id."""
    turns = [prompt] if isinstance(prompt, str) else [dict(m) for m in prompt]
    return hashlib.sha256(json.dumps(turns, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def source_prompts(sources: Sequence[str], seed: int = 0) -> list[tuple[str, Prompt]]:
    """(source name, prompt) for every prompt of each named source (all of it), in
    specdec.training.prompts.collect's interleaved, deduplicated order."""
    from specdec.training.prompts import SOURCES, collect, prompt_text

    owner: dict[str, str] = {}
    for name in sources:
        for p in SOURCES[name](10**6, seed):
            owner.setdefault(prompt_text(p), name)
    return [(owner[prompt_text(p)], p) for p in collect({name: 10**6 for name in sources}, seed)]


def target_identity(target) -> dict:
    """{name, quant, dtype, weights_sha256, tokenizer_sha256}: equal identities produce the same tokens from
    the same prompts."""
    weights = hashlib.sha256()
    for name, tensor in sorted(target.model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        weights.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        weights.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    tok = target.tokenizer
    described = {"class": type(tok).__name__}
    if tok is not None:
        described.update(vocab=sorted(tok.get_vocab().items()) if hasattr(tok, "get_vocab") else None,
                         vocab_size=getattr(tok, "vocab_size", None), chat_template=getattr(tok, "chat_template", None),
                         bos=getattr(tok, "bos_token_id", None), eos=getattr(tok, "eos_token_id", None))
    tokenizer = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()
    return {"name": target.name, "quant": target.quant, "dtype": str(target.dtype).replace("torch.", ""),
            "weights_sha256": weights.hexdigest(), "tokenizer_sha256": tokenizer}


def rollout_settings(*, temperature: float, seed: int, max_new_tokens: int) -> dict:
    """The manifest's `rollout` entry: greedy (temperature 0) or sampled, and what fixes the tokens."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    return {"mode": "greedy" if temperature == 0 else "sampled", "temperature": float(temperature),
            "seed": int(seed), "max_new_tokens": int(max_new_tokens)}


class TokenSet:
    """A rollout set: every shard of one target under one rollout setting. Opening a folder checks its
    manifest and every shard's size and SHA-256 (a ShardError naming the difference or the file)."""

    def __init__(self, root: str | Path, target: dict, rollout: dict, prompts: dict | None = None) -> None:
        self.root = Path(root)
        self.path = self.root / MANIFEST
        if self.path.exists():
            manifest = self._load()
            for key, now in (("target", target), ("rollout", rollout)):
                stored = manifest.get(key, {})
                diff = {k: (stored.get(k), now.get(k)) for k in sorted(set(stored) | set(now)) if stored.get(k) != now.get(k)}
                if diff:
                    raise ShardError(f"{self.path} was written for another {key} ({{field: (stored, now)}}: {diff}); "
                                     "use another set folder or the same " + key)
            self.manifest = manifest
        else:
            self.root.mkdir(parents=True, exist_ok=True)
            self.manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "target": target, "rollout": rollout,
                             "prompts": prompts or {}, "runs": [], "shards": []}
            self._save()
        self.shards = [TokenShard(**s) for s in self.manifest["shards"]]
        for info in self.shards:
            self.verify(info)
        self._loaded = self.path.read_bytes()
        self._held = False

    @classmethod
    def open(cls, root: str | Path) -> TokenSet:
        """An existing set as its manifest records it (for reading: no target to compare against)."""
        path = Path(root) / MANIFEST
        if not path.exists():
            raise ShardError(f"{path} does not exist: {root} is not a rollout set")
        manifest = json.loads(path.read_text())
        return cls(root, manifest.get("target", {}), manifest.get("rollout", {}))

    def _load(self) -> dict:
        try:
            manifest = json.loads(self.path.read_text())
        except json.JSONDecodeError as err:
            raise ShardError(f"{self.path} is not valid JSON ({err})") from err
        if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
            raise ShardError(f"{self.path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}, "
                             f"this specdec reads {FORMAT!r} version {FORMAT_VERSION}")
        return manifest

    def _save(self) -> None:
        text = json.dumps(self.manifest, indent=1) + "\n"
        _write_atomic(self.path, lambda p: p.write_text(text))

    @property
    def target(self) -> dict:
        return self.manifest["target"]

    @property
    def rollout(self) -> dict:
        return self.manifest["rollout"]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    def done(self) -> set[str]:
        """Ids of the prompts some recorded shard continues."""
        return {p for s in self.shards for p in s.prompt_ids}

    def verify(self, info: TokenShard) -> Path:
        """The shard's path after checking it exists with 2 x its tokens in bytes and its SHA-256."""
        path = self.root / info.file
        if not path.exists():
            raise ShardError(f"token shard {path} is recorded in {self.path} but missing")
        size = path.stat().st_size
        if size != info.bytes or info.bytes != TOKEN_DTYPE.itemsize * info.num_tokens:
            raise ShardError(f"token shard {path} is truncated or altered: {size} bytes, {self.path} records "
                             f"{info.bytes} bytes for {info.num_tokens} tokens")
        if file_sha256(path) != info.sha256:
            raise ShardError(f"token shard {path} is corrupt: its SHA-256 differs from {self.path}'s")
        return path

    def read(self, info: TokenShard) -> list[torch.Tensor]:
        """The shard's sequences, each [L] long, verified first."""
        flat = torch.from_numpy(np.fromfile(self.verify(info), dtype=TOKEN_DTYPE).astype(np.int64))
        return list(flat.split(info.length))

    def check_unchanged(self) -> None:
        """ShardError if the manifest on disk is no longer the one this object read or last wrote."""
        if not self.path.exists() or self.path.read_bytes() != self._loaded:
            raise ShardError(f"{self.path} changed underneath this run (another writer, or a copy over it); "
                             "reopen the set")

    def append(self, sequences: Sequence[torch.Tensor], prompt_ids: list[str], sources: list[str],
               prompt_len: list[int], run: dict) -> TokenShard:
        """Write the next shard (sequences of prompts not done yet) and record it, adding the tokens
        to `run` (an entry of `runs`, matched by its `started` field). Needs `writing()`."""
        if not self._held:
            raise ShardError(f"append to {self.root} outside `with tset.writing():` (one writer per set)")
        self.check_unchanged()
        if not (len(sequences) == len(prompt_ids) == len(sources) == len(prompt_len)):
            raise ValueError("sequences, prompt_ids, sources and prompt_len must have one entry per sequence")
        again = sorted(set(prompt_ids) & self.done()) or sorted(p for p in set(prompt_ids) if prompt_ids.count(p) > 1)
        if again:
            raise ShardError(f"prompts {again[:3]} are already in {self.path} (or twice in this shard): a set never "
                             "holds a prompt twice")
        flat = torch.cat([s.reshape(-1) for s in sequences]).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > np.iinfo(TOKEN_DTYPE).max):
            raise ShardError(f"token ids {int(flat.min())}..{int(flat.max())} do not fit uint16 shards")
        index = len(self.shards)
        name = f"shard-{index:05d}.u16"
        _write_atomic(self.root / name, lambda p: flat.numpy().astype(TOKEN_DTYPE).tofile(p))
        path = self.root / name
        info = TokenShard(index=index, file=name, bytes=path.stat().st_size, sha256=file_sha256(path),
                          prompt_ids=list(prompt_ids), sources=list(sources), prompt_len=[int(n) for n in prompt_len],
                          length=[int(s.numel()) for s in sequences])
        self.shards.append(info)
        self.manifest["shards"].append(asdict(info))
        entry = next((r for r in self.manifest["runs"] if r["started"] == run["started"]), None)
        if entry is None:
            self.manifest["runs"].append(run)
            entry = run
        entry["shards"] = entry.get("shards", 0) + 1
        entry["tokens"] = entry.get("tokens", 0) + info.num_tokens
        entry["generated_tokens"] = entry.get("generated_tokens", 0) + info.num_tokens - sum(info.prompt_len)
        entry["seconds"] = round(time.time() - run["started_unix"], 1)
        self._save()
        self._loaded = self.path.read_bytes()
        return info

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold `<set>/write.lock` (the writer's pid): ShardError if a live process holds it; a lock whose
        process is gone is taken over."""
        path = self.root / LOCK
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                pid = int(path.read_text().strip() or 0)
                if _alive(pid):
                    raise ShardError(f"{path} is held by process {pid}: one writer per rollout set") from None
                path.unlink()  # left by a killed run
        else:
            raise ShardError(f"could not take {path}")
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        self._held = True
        try:
            yield
        finally:
            self._held = False
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def set_checksum(sets: Sequence[TokenSet]) -> str:
    """SHA-256 over the sets' targets, rollout settings and shard checksums, in order: a training run
    records it and refuses to resume on another shard set."""
    digest = hashlib.sha256()
    for s in sets:
        digest.update(json.dumps([s.target, s.rollout, [x.sha256 for x in s.shards]], sort_keys=True).encode())
    return digest.hexdigest()


def fill_token_set(target, tset: TokenSet, prompts: Sequence[tuple[str, Prompt]], *, shard_prompts: int,
                   batch_size: int, deadline: float = float("inf"), max_shards: int | None = None,
                   run: dict | None = None, log=print) -> int:
    """Roll out every prompt of `prompts` ((source, prompt) pairs) that `tset` lacks, a shard at a time, until
    `deadline` (an incomplete shard is dropped) or `max_shards`; returns the shards written."""
    from specdec.training.eagle import rollout_batch

    settings = tset.rollout
    ids = [prompt_id(p) for _, p in prompts]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise ValueError(f"the prompt list holds prompt {dup} twice; deduplicate it (prompts.collect does)")
    done = tset.done()
    todo = [k for k, i in enumerate(ids) if i not in done]
    run = run or {}
    run.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    run.setdefault("started_unix", time.time())
    written = 0
    with tset.writing():
        for start in range(0, len(todo), shard_prompts):
            if (max_shards is not None and written >= max_shards) or time.time() > deadline:
                break
            rows = todo[start:start + shard_prompts]
            generator = torch.Generator().manual_seed(settings["seed"] * 1_000_003 + len(tset.shards))
            parts = []
            for b in range(0, len(rows), batch_size):
                if time.time() > deadline:
                    break
                parts.append(rollout_batch(target, [prompts[k][1] for k in rows[b:b + batch_size]],
                                           max_new_tokens=settings["max_new_tokens"],
                                           temperature=settings["temperature"], generator=generator))
            if sum(len(p.sequences) for p in parts) < len(rows):
                log(f"deadline reached inside a shard: its prompts stay to do ({len(tset.done())} prompts done)")
                break
            sequences = [s for p in parts for s in p.sequences]
            info = tset.append(sequences, [ids[k] for k in rows], [prompts[k][0] for k in rows],
                               [n for p in parts for n in p.prompt_len], run)
            written += 1
            entry = tset.manifest["runs"][-1]
            log(json.dumps({"shard": info.file, "tokens": info.num_tokens, "set_tokens": tset.num_tokens,
                            "prompts_done": len(tset.done()), "prompts_total": len(ids),
                            "run_generated_tok_per_s": round(entry["generated_tokens"] / max(entry["seconds"], 1e-9), 1)}))
    return written
