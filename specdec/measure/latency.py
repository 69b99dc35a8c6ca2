"""A target's measured latency curve: forward time as a function of width and context length.

Owns `CurveTimer` (passes that can be spread over time), `measure_latency` and `cached_latency` (kept in the tune
record); the curve is data (`specdec.core.curve.LatencyCurve`). Knows nothing about drafters or shapes.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec import machine
from specdec.runtime.forwards import CACHES, resolve_cache, verification_width
from specdec.core.curve import LatencyCurve
from specdec.loop.tuned import curve_prefix
from specdec.runtime.model import Target


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CurveTimer:
    """Times a latency curve in passes: `sample()` times every width after every context (order rotated), `curve()` is
    the median so far; caches are filled and warmed at construction (arguments: `measure_latency`)."""

    def __init__(self, target: Target, widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                 contexts: tuple[int, ...] = (256,), seed: int = 0, cache: str = "dynamic", batch: int = 1,
                 holes: bool = False) -> None:
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
        longest = max(contexts) + max(widths)
        if longest > target.context_length:
            raise ValueError(f"latency context {max(contexts)} + width {max(widths)} exceeds {target.label!r}'s "
                             f"context length {target.context_length}")
        self.target, self.widths, self.contexts = target, tuple(widths), tuple(contexts)
        self.batch, self.holes = batch, holes
        kind = resolve_cache(cache, target, batch)
        widest, buckets = verification_width(kind, max(widths), None)
        self.padded = bool(buckets)  # compiled or graphed: each width runs at its bucket
        self._gen = torch.Generator().manual_seed(seed)
        self._caches = []
        for context in self.contexts:
            kv, forward = CACHES[kind](target, context + widest, buckets, owner=f"curve after {context}")
            if context:
                prefix = torch.randint(0, target.vocab_size, (batch, context), generator=self._gen)
                target.forward(prefix, kv, logits_rows=slice(-1, None))
            self._caches.append((context, kv, forward))
        self._times: dict[tuple[int, int], list[float]] = {(c, w): [] for c in self.contexts for w in self.widths}
        self.passes = 0
        self._pass(timed=False)

    def sample(self) -> None:
        """One timed pass over every (context, width)."""
        self._pass(timed=True)
        self.passes += 1

    def _pass(self, timed: bool) -> None:
        turn = self.passes % len(self.widths)
        order = self.widths[turn:] + self.widths[:turn]
        for context, kv, forward in self._caches:
            for w in order:
                tokens = torch.randint(0, self.target.vocab_size, (self.batch, w), generator=self._gen)
                parents = torch.full((w,), -1, dtype=torch.long)
                _sync(self.target.device)
                t0 = time.perf_counter()
                if self.holes:
                    forward(tokens, kv, parents, valid=torch.ones(self.batch, w, dtype=torch.bool))
                else:
                    forward(tokens, kv, parents)
                _sync(self.target.device)
                if timed:
                    self._times[context, w].append(time.perf_counter() - t0)
                kv.truncate(context)

    def curve(self) -> LatencyCurve:
        """The median of the passes so far (at least one)."""
        if not self.passes:
            raise ValueError("a latency curve needs at least one timed pass: call sample() first")
        target = self.target
        seconds = tuple(tuple(statistics.median(self._times[c, w]) for w in self.widths) for c in self.contexts)
        return LatencyCurve(target=target.label, device=str(target.device),
                            dtype=str(target.dtype).replace("torch.", ""), machine=machine.machine_name(target.device),
                            threads=torch.get_num_threads(), widths=self.widths, contexts=self.contexts,
                            seconds=seconds, batch=self.batch, holes=self.holes, padded=self.padded)


def measure_latency(target: Target, widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                    contexts: tuple[int, ...] = (256,), repeats: int = 5, seed: int = 0,
                    cache: str = "dynamic", batch: int = 1, holes: bool = False) -> LatencyCurve:
    """Time one forward of each width after each context (median of `repeats` `CurveTimer` passes) through `cache`'s
    forward; `batch` > 1 times that many rows, `holes` under a batch-with-holes mask."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    timer = CurveTimer(target, widths, contexts, seed=seed, cache=cache, batch=batch, holes=holes)
    for _ in range(repeats):
        timer.sample()
    return timer.curve()


def curve_key(target: Target, widths: tuple[int, ...], contexts: tuple[int, ...], repeats: int, cache: str,
              batch: int = 1, holes: bool = False) -> str:
    """A curve's name inside the target's tune record: kernel, attention, threads, grid, cache kind, batch and holes
    (a batch of one without holes adds nothing)."""
    parts = ["w" + "-".join(map(str, widths)), "c" + "-".join(map(str, contexts)), f"r{repeats}"]
    return curve_prefix(target, cache) + "_".join(parts + ([f"b{batch}"] if batch > 1 else []) + (["holes"] if holes else []))


def cached_latency(target: Target, widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                   contexts: tuple[int, ...] = (256,), repeats: int = 5, cache: str = "dynamic",
                   batch: int = 1, holes: bool = False) -> LatencyCurve:
    """The curve stored in the target's tune record under `curve_key`, else `measure_latency` once and store it there. A
    measuring tool (the grid's runner, `specdec.tune`): constructors call `tuned_latency`, which never measures."""
    kind = resolve_cache(cache, target, batch)
    key = curve_key(target, tuple(widths), tuple(contexts), repeats, kind, batch, holes)
    record = machine.load_record(target.label, target.device, target.dtype) or {}
    if key in record.get("curves", {}):
        return LatencyCurve.from_json(record["curves"][key], f"tune record curve {key}")
    curve = measure_latency(target, widths, contexts, repeats, cache=kind, batch=batch, holes=holes)
    machine.update_record(target.label, target.device, target.dtype, curves={key: curve.to_json()})
    return curve
