"""The latency curve: `LatencyCurve`, median forward seconds per (context, width) as data, its interpolation and files.
Knows nothing about how a curve is timed (`specdec.measure.latency`) or looked up (`specdec.loop.tuned`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


SCHEMA = "specdec.measure.latency/1"


@dataclass(frozen=True)
class LatencyCurve:
    """Median forward seconds of a target per (context length, width)."""

    target: str  # The target's label (`name` or `name@quant`).
    device: str
    dtype: str
    machine: str  # `machine_name()` of the device the times were taken on.
    threads: int  # torch intra-op threads during the measurement.
    widths: tuple[int, ...]  # Tokens per forward, ascending, starting at 1.
    contexts: tuple[int, ...]  # Cached tokens before the forward, ascending.
    seconds: tuple[tuple[float, ...], ...]  # seconds[c][w]: median time of one forward at contexts[c], widths[w].
    batch: int = 1  # Rows per forward: each of `batch` rows forwards w tokens after c cached (a batch's verification).
    holes: bool = False  # Timed as rows with holes run (an explicit mask over the real entries: `measure_latency`).
    padded: bool = False  # Timed through width buckets (compiled, graphed): a width between two costs the next one's.

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(self, "contexts", tuple(int(c) for c in self.contexts))
        object.__setattr__(self, "seconds", tuple(tuple(float(t) for t in row) for row in self.seconds))
        if not self.widths or list(self.widths) != sorted(set(self.widths)) or self.widths[0] != 1:
            raise ValueError(f"latency widths must be ascending, distinct and start at 1, got {self.widths}")
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"latency contexts must be ascending and distinct, got {self.contexts}")
        if len(self.seconds) != len(self.contexts) or any(len(r) != len(self.widths) for r in self.seconds):
            raise ValueError(f"latency seconds must be [contexts={len(self.contexts)}][widths={len(self.widths)}]")

    def at(self, width: int, context: int | None = None) -> float:
        """Seconds of one forward of `width` tokens after `context` cached (default: the smallest context measured),
        linear between measured points (`padded`: the next measured width's) and beyond the last two."""
        row = self._row(context)
        if self.padded and width <= self.widths[-1]:
            return row[next(i for i, w in enumerate(self.widths) if w >= width)]
        return _interp(self.widths, row, width)

    def ratio(self, width: int, context: int | None = None) -> float:
        """Cost of a `width`-token forward in units of a one-token forward."""
        return self.at(width, context) / self.at(1, context)

    def _row(self, context: int | None) -> list[float]:
        if context is None or len(self.contexts) == 1:
            return list(self.seconds[0])
        return [_interp(self.contexts, [r[w] for r in self.seconds], context) for w in range(len(self.widths))]

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @staticmethod
    def from_json(data: dict, source: str = "<dict>") -> LatencyCurve:
        """Parse a curve saved by `to_json`; ValueError naming `source` and the missing keys if not one."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"{source} is not a latency curve: expected a JSON object with "
                             f"\"schema\": \"{SCHEMA}\" (write one with specdec.measure.latency.measure_latency)")
        fields = ("target", "device", "dtype", "machine", "threads", "widths", "contexts", "seconds")
        missing = [f for f in fields if f not in data]
        if missing:
            raise ValueError(f"latency curve {source} lacks {', '.join(missing)}")
        return LatencyCurve(**{f: data[f] for f in fields}, batch=int(data.get("batch", 1)),
                            holes=bool(data.get("holes", False)), padded=bool(data.get("padded", False)))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)

    @staticmethod
    def load(path: str | Path) -> LatencyCurve:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read latency curve {path}: {err}") from None
        return LatencyCurve.from_json(data, str(path))


def _interp(xs: tuple[int, ...] | list[int], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
