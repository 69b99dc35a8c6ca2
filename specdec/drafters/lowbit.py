"""Low-bit self-draft: the `lowbit` drafter, a `self_draft` preset (`weights=` a quantized copy, default
`DEFAULT_QUANT`; tiny test models `rtn8_pc`). Knows nothing about quantization beyond the spec it passes on.
"""

from __future__ import annotations

from specdec.drafters.registry import register
from specdec.drafters.self_draft import SelfDrafter, build_self_draft
from specdec.runtime.model import Target

DEFAULT_QUANT = "torchao_int4"
"""The low-bit copy whose 1-4 token forward was the fastest of those tried on CPUs, with high top-1
agreement (`scripts/bench_quant.py` measures them). Needs the `torchao` extra."""


@register("lowbit")
def build_lowbit(*, target: Target, quant: str = DEFAULT_QUANT, cache: str = "auto") -> SelfDrafter:
    """A drafter running a `quant`-quantized copy of `target` (any `specdec.quant` spec); `cache`
    is the copy's own cache kind (`specdec.runtime.forwards.drafter_cache`)."""
    return build_self_draft(target=target, weights=quant, name="lowbit", cache=cache)


build_lowbit.test_options = {"quant": "rtn8_pc"}
