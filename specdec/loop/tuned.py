"""The latency curve a shape policy plans with: `tuned_latency`, looked up in the machine's tune record, never measured;
`curve_prefix` (what a lookup matches; `specdec.measure.latency.curve_key` builds on it). Knows nothing about timing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec import machine
from specdec.core.curve import LatencyCurve
from specdec.runtime.forwards import resolve_cache

if TYPE_CHECKING:
    from specdec.runtime.model import Target


def curve_prefix(target: Target, cache: str) -> str:
    """The start of every stored curve name for `target` under cache kind `cache`: the kernel, the
    attention and the threads, which change a curve's times beside the machine that names the record."""
    return f"{cache}_{target.kernel}_{target.attention}_t{torch.get_num_threads()}_"


DEFAULT_WIDTH_COST = 1 / 24  # The untuned curve's cost of each token past the first, in units of a one-token forward.


def tuned_latency(target: Target, cache: str = "dynamic", batch: int = 1) -> LatencyCurve:
    """The latency curve `shape="auto"` plans with, looked up, never measured: the widest stored for this
    target, kernel, attention, threads, cache and batch in the machine's tune record, else the untuned
    t(w) = 1 + (batch * w - 1) * DEFAULT_WIDTH_COST, whose `machine` says "not tuned"."""
    kind = resolve_cache(cache, target, batch)
    prefix = curve_prefix(target, kind) + "w"
    record = machine.load_record(target.label, target.device, target.dtype) or {}
    curves = record.get("curves", {})
    stored = sorted((k for k in curves if k.startswith(prefix) and int(curves[k].get("batch", 1)) == batch),
                    key=lambda k: (len(curves[k].get("widths") or ()), k))
    if stored:
        return LatencyCurve.from_json(curves[stored[-1]], f"tune record curve {stored[-1]}")
    widths = (1, 2, 4, 8, 16, 32, 64, 128)
    return LatencyCurve(target=target.label, device=str(target.device), dtype=str(target.dtype).replace("torch.", ""),
                        machine="not tuned", threads=torch.get_num_threads(), widths=widths, contexts=(0,),
                        seconds=((tuple(1 + (batch * w - 1) * DEFAULT_WIDTH_COST for w in widths)),), batch=batch)
