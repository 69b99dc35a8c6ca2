"""The cost model: a cell's speculation speedup predicted out of sample, and projections to other hardware.

Owns `DraftProfile` (drafting cost and target forwards of each width per new token, measured on *other* runs),
`PlainRun` (the plain run on the target being predicted), `predict_speculation` (the held-out prediction and its
flat-curve null), `RunParts` / `predict` / `project` (speedups with another device's curves), `mal_from_acceptance`
/ `drafting_scale` (a shorter chain from a deeper one) and `Device` / `DEVICES` / `roofline_curve` /
`measured_overhead` (a roofline curve whose per-forward overhead is measured, never assumed). Knows nothing about
drafters, stores or reports. A drafted run of N new tokens takes

    T_d = P + N * sum_w phi_w * (t_1 * R(w, c) + delta),      speculation = T_p / T_d

with phi_w the target forwards of width w per new token (sum = 1 / MAL) and delta the seconds per step outside the
target's forward, both from a DraftProfile measured elsewhere; P, t_1, T_p and N from the plain run; R(w, c) =
L(w, c) / L(1, c) the shape of the latency curve at the mean context c. A batch step costs f_r R_r(w, c) + the plain
step's other seconds at r rows decoding. Nulls: *flat curve* (R = 1) and *constant* (1.0x). Roofline: L(w, c) =
overhead + max(bytes / bandwidth, flops / peak), bytes = weights + KV read and written (c + w positions), flops =
2 * params * w + 4 * layers * hidden * w * (c + w).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specdec.core.curve import LatencyCurve


@dataclass(frozen=True)
class DraftProfile:
    """phi_w and delta of the model (module docstring), from drafted runs other than the predicted one."""

    forwards_per_token: Mapping[int, float]
    """phi_w: target forwards of width w per new token."""
    other_per_step_s: float
    """delta: seconds per drafted step outside the target's forward."""
    shapes_per_token: Mapping[tuple[int, int], float] | None = None
    """A batch's phi by (rows still decoding, padded width), where its runs recorded them (rows leave a
    batch as they finish); the same forwards as `forwards_per_token`, split by rows."""

    @classmethod
    def from_runs(cls, new_tokens: int, forwards: Mapping[int, int], other_s: float,
                  shapes: Mapping[tuple[int, int], int] | None = None) -> DraftProfile:
        """From summed drafted runs: tokens, forwards per width, seconds outside the forwards (and a
        batch's forwards per (rows, width))."""
        steps = sum(forwards.values())
        if new_tokens <= 0 or steps <= 0:
            raise ValueError(f"a draft profile needs tokens and steps, got {new_tokens} tokens, {steps} steps")
        if shapes is not None and sum(shapes.values()) != steps:
            raise ValueError(f"{sum(shapes.values())} steps by (rows, width) against {steps} by width")
        return cls({int(w): n / new_tokens for w, n in forwards.items()}, other_s / steps,
                   None if shapes is None else {(int(r), int(w)): n / new_tokens for (r, w), n in shapes.items()})


@dataclass(frozen=True)
class PlainRun:
    """The plain loop's measured run (summed over prompts) on the target whose speculation is predicted."""

    new_tokens: int
    seconds: float
    """T_p: wall time."""
    prefill_s: float
    forward_s: float
    """t_1: mean one-token forward (its forwards' time / steps)."""
    context: float
    """c: mean cached tokens at a step."""
    batch: int = 1
    """Rows decoded together (`specdec.generate_batch`): t_1 is then one batched one-token forward."""
    row_forward_s: Mapping[int, float] | None = None
    """A batch's f_r: the mean one-token forward of its plain steps with r rows still decoding (where
    measured); t_1 is then f_r + `step_other_s`."""
    step_other_s: float = 0.0
    """With `row_forward_s`: seconds of a plain step outside its forward (acceptance, bookkeeping)."""


def predict_speculation(draft: DraftProfile, plain: PlainRun, curve: LatencyCurve | None,
                        row_curves: Mapping[int, LatencyCurve] | None = None) -> float:
    """T_p / T_d of the module docstring; `curve=None` is the flat-curve null (R = 1). A batch is priced on
    the curve at its batch size, a step's width being its padded width. With the profile's steps by (rows
    r, width w) and `row_curves` ({r: L_r}, B included), a step costs f_r R_r(w, c) + the plain step's
    other seconds + delta, f_r of a row count the plain run never reached being f_B L_r(1, c) / L_B(1, c);
    the flat null with `row_curves` takes R_r = 1 and f_B there."""
    if curve is not None and curve.batch != plain.batch:
        raise ValueError(f"the latency curve was measured at batch {curve.batch}, the run decodes batch {plain.batch}: "
                         f"measure one at that batch (python -m specdec.tune TARGET --batch {plain.batch})")
    if draft.shapes_per_token and plain.row_forward_s and row_curves:
        curves = None if curve is None else row_curves
        per_token = sum(phi * (batch_step_s(plain, r, w, curves) + draft.other_per_step_s)
                        for (r, w), phi in draft.shapes_per_token.items())
        return plain.seconds / (plain.prefill_s + plain.new_tokens * per_token)

    def ratio(w: int) -> float:
        return 1.0 if curve is None else curve.at(w, plain.context) / curve.at(1, plain.context)

    per_token = sum(phi * (plain.forward_s * ratio(w) + draft.other_per_step_s)
                    for w, phi in draft.forwards_per_token.items())
    return plain.seconds / (plain.prefill_s + plain.new_tokens * per_token)


def batch_step_s(plain: PlainRun, rows: int, width: int, curves: Mapping[int, LatencyCurve] | None) -> float:
    """Seconds of a batch step outside drafting with `rows` rows of `width` (`predict_speculation`; with
    `plain.step_other_s` = 0, its forward alone)."""
    c, measured = plain.context, plain.row_forward_s
    if curves is None:  # the flat null
        return measured.get(rows, measured[plain.batch]) + plain.step_other_s
    if rows not in curves or plain.batch not in curves:
        raise ValueError(f"a batch step with {rows} rows left needs the curves at {rows} and {plain.batch} rows, "
                         f"got curves at {sorted(curves)} rows")
    f = measured.get(rows, measured[plain.batch] * curves[rows].at(1, c) / curves[plain.batch].at(1, c))
    return f * curves[rows].ratio(width, c) + plain.step_other_s


@dataclass(frozen=True)
class RunParts:
    """What the runs of one kind (drafted, plain or reference) of a cell measured, summed over prompts."""

    new_tokens: int
    """Tokens generated."""
    forwards: Mapping[int, int]
    """Target forwards (verification steps) per width: {1 + draft nodes: count}; plain runs: {1: steps}."""
    context: float
    """Mean cached tokens at a step (prompt + half the new tokens, averaged over prompts)."""
    prefill_s: float
    """Measured prefill seconds."""
    other_s: float
    """Measured seconds outside the target's decode forwards: drafting, acceptance, bookkeeping."""

    def forward_s(self, curve: LatencyCurve) -> float:
        """The target's decode forwards costed by `curve`."""
        return sum(n * curve.at(int(w), self.context) for w, n in self.forwards.items())

    def seconds(self, curve: LatencyCurve, scale: float = 1.0) -> float:
        """Predicted run time with the forwards from `curve` and measured times scaled by `scale`."""
        return scale * (self.prefill_s + self.other_s) + self.forward_s(curve)

    def tokens_per_s(self, curve: LatencyCurve, scale: float = 1.0) -> float:
        return self.new_tokens / self.seconds(curve, scale)


@dataclass(frozen=True)
class Prediction:
    """Predicted speedups of a cell (see the module docstring for which inputs are measured)."""

    speedup: float
    """Speculation alone: drafted / plain on the same target."""
    speedup_quant: float
    """Quantization alone: plain on the target / plain on the reference."""
    speedup_compound: float
    """Drafted on the target / plain on the reference."""


def predict(drafted: RunParts, plain: RunParts, reference: RunParts, target_curve: LatencyCurve,
            reference_curve: LatencyCurve, target_scale: float = 1.0, reference_scale: float = 1.0) -> Prediction:
    """The three speedups of a cell from its measured parts and the two latency curves; `*_scale`
    multiply the measured non-forward times (1 on the machine they were measured on)."""
    d = drafted.tokens_per_s(target_curve, target_scale)
    p = plain.tokens_per_s(target_curve, target_scale)
    r = reference.tokens_per_s(reference_curve, reference_scale)
    return Prediction(speedup=d / p, speedup_quant=p / r, speedup_compound=d / r)


def mal_from_acceptance(reached: list[int], accepted: list[int], steps: int) -> float:
    """MAL = 1 + sum_d accepted_d / steps, where accepted_d counts steps whose accepted path reached
    depth d (`GenerationStats.acceptance_counts_by_depth`). E.g. 10 steps, accepted [8, 5, 2] -> 2.5."""
    if steps <= 0:
        raise ValueError(f"steps must be > 0, got {steps}")
    if len(reached) != len(accepted) or any(a > r for a, r in zip(accepted, reached)):
        raise ValueError(f"accepted {accepted} must be per-depth counts no larger than reached {reached}")
    return 1.0 + sum(accepted) / steps


def drafting_scale(k: int, depth: int, probe: Mapping[int, float]) -> float:
    """Drafting seconds per step of a chain(k) over those of a chain(`depth`), from a probe {d: drafting
    seconds of a step that drafted d nodes} at two or more depths: a fixed part plus a part per depth
    (EAGLE: one head pass over the newly accepted tokens, then one head step and scoring per further
    node), the least-squares line through the probe, read at k and at `depth`. E.g. probe {1: 3.0, 4: 6.0}
    is the line 2.0 + 1.0 d, so chain(2) / chain(4) = 4.0 / 6.0 (k / depth would say 2 / 4)."""
    points = [(int(d), float(t)) for d, t in probe.items()]
    if len({d for d, _ in points}) < 2:
        raise ValueError(f"a drafting probe needs two or more depths to separate the fixed part, got {dict(probe)}")
    mean_d = sum(d for d, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = (sum((d - mean_d) * (t - mean_t) for d, t in points) / sum((d - mean_d) ** 2 for d, _ in points))

    def line(d: int) -> float:
        return mean_t + slope * (d - mean_d)

    if line(k) <= 0 or line(depth) <= 0:
        raise ValueError(f"the drafting probe {dict(probe)} gives no positive time at depth {k} or {depth}")
    return line(k) / line(depth)


# ---- other hardware ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """A device for a roofline projection."""

    name: str
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    flops: float
    """Peak dense 16-bit tensor throughput, FLOP/s."""


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("H200", bandwidth=4.8e12, flops=989e12),
    Device("H100", bandwidth=3.35e12, flops=989e12),
    Device("A100", bandwidth=2.0e12, flops=312e12),
    Device("RTX3090", bandwidth=936e9, flops=71e12),
)}
"""Datasheet bandwidth and dense bf16/fp16 peak (SXM parts; RTX 3090 with fp32 accumulation). The
per-forward overhead (kernel launches of an eager batch-1 forward) is not a datasheet figure: it comes
from a curve measured on the device (`measured_overhead`)."""


def device(name: str) -> Device:
    """The known device `name` (case and `-`/space insensitive); ValueError listing the known ones."""
    key = {n.lower(): n for n in DEVICES}.get(name.lower().replace("-", "").replace(" ", ""))
    if key is None:
        raise ValueError(f"unknown device {name!r} for a roofline projection; known devices: {', '.join(DEVICES)} "
                         "(or project from a latency curve file measured on the device)")
    return DEVICES[key]


def _roofline_s(dev: Device, sizes: Mapping[str, float], w: int, c: float) -> float:
    """max(bytes / bandwidth, flops / peak) of one forward of width w at context c (no overhead)."""
    kv_per_position = 2 * sizes["layers"] * sizes["kv_heads"] * sizes["head_dim"] * sizes["kv_bytes_per_element"]
    bytes_ = sizes["weight_bytes"] + kv_per_position * (c + w)
    flops = 2 * sizes["params"] * w + 4 * sizes["layers"] * sizes["hidden"] * w * (c + w)
    return max(bytes_ / dev.bandwidth, flops / dev.flops)


def measured_overhead(dev: Device, curve: LatencyCurve, sizes: Mapping[str, float]) -> float:
    """The per-forward overhead on `dev`: `curve`'s one-token forward (measured there, smallest context)
    minus the roofline's time for a model of `sizes`, floored at 0. ValueError when the curve's
    `machine` does not name the device (a curve from another machine would give another overhead)."""
    if dev.name.lower() not in curve.machine.lower().replace("-", "").replace(" ", ""):
        raise ValueError(f"the overhead curve for {dev.name} was measured on {curve.machine!r}, not on a {dev.name}: "
                         "give a latency curve file measured on that device")
    c = min(curve.contexts)
    return max(0.0, curve.at(1, c) - _roofline_s(dev, sizes, 1, c))


def roofline_curve(dev: Device, sizes: Mapping[str, float], widths: tuple[int, ...],
                   contexts: tuple[int, ...], target: str = "", *, overhead_s: float) -> LatencyCurve:
    """A latency curve for `dev` from a roofline of a model with `sizes` (params, weight_bytes, layers,
    hidden, kv_heads, head_dim, kv_bytes_per_element: the runner's `model_sizes`), plus `overhead_s`
    per forward (`measured_overhead`)."""

    def seconds(w: int, c: int) -> float:
        return overhead_s + _roofline_s(dev, sizes, w, c)

    return LatencyCurve(target=target, device=f"roofline:{dev.name}", dtype="as measured here", machine=dev.name,
                        threads=0, widths=widths, contexts=contexts,
                        seconds=tuple(tuple(seconds(w, c) for w in widths) for c in contexts))


def project(drafted: RunParts, plain: RunParts, reference: RunParts, measured: tuple[LatencyCurve, LatencyCurve],
            projected: tuple[LatencyCurve, LatencyCurve]) -> Prediction:
    """The cell's speedups on other hardware: `projected` (target, reference) curves replace the
    `measured` ones, and the measured non-forward times scale by the one-token forward time ratio."""
    scales = [p.at(1, run.context) / m.at(1, run.context)
              for p, m, run in zip(projected, measured, (plain, reference))]
    return predict(drafted, plain, reference, projected[0], projected[1], *scales)
