"""The cost model: a cell's speedups predicted from its parts, and projected to other hardware.

Owns `RunParts` (what one kind of run of a cell measured: tokens, target forwards per verify width,
context, and the seconds spent outside the target's forwards), `predict` (the three speedups from
the runs' parts and the latency curves of the target and of the unquantized reference),
`mal_from_acceptance` and `chain_mal` (mean acceptance length from per-depth acceptance counts, and
its projection to a shorter chain), `Device` / `DEVICES` / `roofline_curve` (a latency curve for a
named device from a roofline) and `project` (the same prediction with projected curves).

The model. A run's time = prefill + time outside the target's forwards (drafting, acceptance, loop
bookkeeping: all measured) + the target's forwards, each costed by the latency curve at its width
(1 + draft nodes) and at the run's mean context:

    T = prefill + other + sum_w n_w * L(w, c),      tokens/s = N / T

with n_w the number of verification steps of width w, i.e. N / MAL steps in all (MAL from the
measured acceptance per depth). Speculation alone = drafted tokens/s / plain tokens/s on the same
curve; quantization alone = plain on the target's curve / plain on the reference's; compound =
drafted / reference plain. *Measured*: MAL, acceptance per depth, steps per width, prefill, drafting
and other times, the latency curves. *Predicted*: every forward time (from the curve, not from the
runs) and hence every speedup. *Projected*: the same with another device's curve (a file measured
there, or a roofline), every measured non-forward time scaled by the ratio of one-token forward
times (a model drafter runs on the same device as the target; an assumption, stated in the report).

A roofline forward: L(w, c) = overhead + max(bytes / bandwidth, flops / peak), bytes = weights +
KV entries read and written (c + w positions), flops = 2 * params * w + 4 * layers * hidden * w * (c + w).
Knows nothing about drafters, stores or reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specdec.measure.latency import LatencyCurve


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


def chain_mal(reached: list[int], accepted: list[int], depth: int) -> float:
    """MAL of a chain of `depth` from the acceptance per depth of a deeper chain: 1 + sum_{d <= depth}
    P(accepted path reaches d | draft reached d). Exact for a drafter whose proposal at depth d does not
    depend on how deep it drafts; a chain deeper than the one measured is an error."""
    if depth > len(reached):
        raise ValueError(f"acceptance was measured to depth {len(reached)}; cannot project a chain of {depth}")
    return 1.0 + sum(a / r for a, r in zip(accepted[:depth], reached[:depth]) if r)


# ---- other hardware ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """A device for a roofline projection."""

    name: str
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    flops: float
    """Peak dense 16-bit tensor throughput, FLOP/s."""
    overhead_s: float
    """Per-forward fixed cost (kernel launches of an eager batch-1 decoder forward), seconds."""


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("H200", bandwidth=4.8e12, flops=989e12, overhead_s=3e-3),
    Device("H100", bandwidth=3.35e12, flops=989e12, overhead_s=3e-3),
    Device("A100", bandwidth=2.0e12, flops=312e12, overhead_s=3e-3),
    Device("RTX3090", bandwidth=936e9, flops=71e12, overhead_s=3e-3),
)}
"""Datasheet bandwidth and dense bf16/fp16 peak (SXM parts; RTX 3090 with fp32 accumulation); the
overhead is an assumption for an eager PyTorch forward of a ~30-layer model at batch 1."""


def device(name: str) -> Device:
    """The known device `name` (case and `-`/space insensitive); ValueError listing the known ones."""
    key = {n.lower(): n for n in DEVICES}.get(name.lower().replace("-", "").replace(" ", ""))
    if key is None:
        raise ValueError(f"unknown device {name!r} for a roofline projection; known devices: {', '.join(DEVICES)} "
                         "(or project from a latency curve file measured on the device)")
    return DEVICES[key]


def roofline_curve(dev: Device, sizes: Mapping[str, float], widths: tuple[int, ...],
                   contexts: tuple[int, ...], target: str = "") -> LatencyCurve:
    """A latency curve for `dev` from a roofline of a model with `sizes` (params, weight_bytes, layers,
    hidden, kv_heads, head_dim, kv_bytes_per_element: the runner's `model_sizes`)."""
    kv_per_position = 2 * sizes["layers"] * sizes["kv_heads"] * sizes["head_dim"] * sizes["kv_bytes_per_element"]

    def seconds(w: int, c: int) -> float:
        bytes_ = sizes["weight_bytes"] + kv_per_position * (c + w)
        flops = 2 * sizes["params"] * w + 4 * sizes["layers"] * sizes["hidden"] * w * (c + w)
        return dev.overhead_s + max(bytes_ / dev.bandwidth, flops / dev.flops)

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
