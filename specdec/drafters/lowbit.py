"""Low-bit self-draft: a quantized copy of the target drafts for the target.

Owns the `lowbit` drafter, a preset of `self_draft` (`weights=quant`, full KV): the draft model is
`specdec.quant.quantized_copy(target, quant)`, the target itself is left untouched, so the verifier
stays exact w.r.t. the unquantized target; the draft reads the target's exact K/V for committed
tokens (see `self_draft`). Knows nothing about quantization beyond the spec string it passes on.

Default spec `torchao_int4` (int4 weight-only, group 32, bf16 activations), chosen by measurement
on the project's CPU (see `DEFAULT_QUANT`). Tiny test models use `rtn8_pc`, which needs no
optional library and fits any layer width.
"""

from __future__ import annotations

from specdec.drafters.base import register
from specdec.drafters.self_draft import SelfDrafter, build_self_draft
from specdec.models import Target

DEFAULT_QUANT = "torchao_int4"
"""Chosen by measurement on the project's CPU machine (2 cores, 1 thread, embedded SmolLM2-135M,
`python scripts/bench_quant.py --specs none,bf16,torchao_int4,... --widths 1,4,16,64 --contexts 128`):
a 1-4 token forward at 0.4-0.6x the fp32 time with 97.7% top-1 agreement (the Q4_1 grid confound
helps it), and in `chain(4)` generation the fastest of torchao_int4 / fp16 / bf16 / dynamic_fp16 /
rtn8 as drafters (8.8 vs 6.3-7.3 tok/s, plain decoding 8.5; a loaded machine). fp16 and bf16 agree
as well or better but run 1-token forwards slower here; RTN changes no speed. Needs the `torchao`
extra."""


@register("lowbit")
def build_lowbit(*, target: Target, quant: str = DEFAULT_QUANT, cache: str = "auto") -> SelfDrafter:
    """A drafter running a `quant`-quantized copy of `target` (any `specdec.quant` spec); `cache`
    is the copy's own cache kind (`specdec.forwards.drafter_cache`)."""
    return build_self_draft(target=target, weights=quant, name="lowbit", cache=cache)


build_lowbit.test_options = {"quant": "rtn8_pc"}
