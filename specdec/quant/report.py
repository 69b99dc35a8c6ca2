"""The quantization report: `quant_report(reference, quantized)`, weight bytes and bits per parameter, top-1 agreement
and KL on `EVAL_TEXT`, and both latency curves timed interleaved, as ratios. Knows nothing about how either was
quantized.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specdec.runtime.cache import KVCache
from specdec.runtime.model import Target
from specdec.quant.texts import EVAL_ID, EVAL_TEXT, text_fingerprint

Q4_1_CONFOUND = (
    "the embedded smollm2-135m weights come from a GGUF Q4_1 file (asymmetric 4-bit, blocks of 32): "
    "its 'full precision' is dequantized 4-bit, so asymmetric 4-bit group-32 requantization lands on "
    "nearly the same grid (near-lossless) while other 4-bit grids (g64, symmetric, nf4) do not"
)


@dataclass(frozen=True)
class ReportConfig:
    """What a quantization report measures."""

    widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Numbers of new tokens per timed forward (a causal chain after the context)."""
    contexts: tuple[int, ...] = (32, 256)  # Cached context lengths the widths are timed after.
    repeats: int = 7  # Timed forwards per (context, width, model); the median is reported.
    warmup: int = 1  # Untimed passes over every width per context and model before timing.
    eval_tokens: int = 256  # Positions of EVAL_TEXT scored for agreement and KL (fewer if the text is shorter).
    latency: bool = True  # Measure the latency curve (False: agreement and KL only, e.g. in tests).


def eval_token_ids(target: Target, length: int) -> list[int]:
    """`length` token ids of EVAL_TEXT repeated as needed (fixed pseudo-random ids for a target without a tokenizer)."""
    if target.tokenizer is not None:
        base = list(target.tokenizer.encode(EVAL_TEXT))
    else:
        generator = torch.Generator().manual_seed(0)
        base = torch.randint(0, target.vocab_size, (512,), generator=generator).tolist()
    return (base * (length // len(base) + 1))[:length]


def agreement(reference: Target, quantized: Target, token_ids: list[int]) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || quantized) of the next-token distributions at every
    position of `token_ids` (one chain forward each)."""
    logp = []
    for target in (reference, quantized):
        out = target.forward(torch.tensor([token_ids]), KVCache())
        logp.append(torch.log_softmax(out.logits[0].to("cpu", torch.float64), -1))  # [L, V]
    ref, quant = logp
    kl = (ref.exp() * (ref - quant)).sum(-1)  # [L]
    return {"top1_agreement": float((ref.argmax(-1) == quant.argmax(-1)).double().mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "positions": len(token_ids)}


def _timed_forward(target: Target, cache: KVCache, tokens: torch.Tensor, context: int) -> float:
    """Seconds for one forward of `tokens` [1, n] after `context` cached tokens; the cache is
    truncated back to `context` afterwards."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    target.forward(tokens, cache)
    sync()
    elapsed = time.perf_counter() - start
    cache.truncate(context)
    return elapsed


def latency_curve(reference: Target, quantized: Target, config: ReportConfig) -> dict[str, Any]:
    """Median forward milliseconds per (context, width) for both models (interleaved) and their ratios."""
    models = (reference, quantized)
    longest = max(config.contexts) + max(config.widths)
    limit = min(m.context_length for m in models)
    if longest > limit:
        raise ValueError(f"context {max(config.contexts)} + width {max(config.widths)} = {longest} exceeds the "
                         f"models' context length {limit}; lower ReportConfig.contexts or widths")
    ids = eval_token_ids(reference, longest)
    out: dict[str, Any] = {"contexts": list(config.contexts), "widths": list(config.widths),
                           "reference_ms": [], "quantized_ms": [], "ratio": []}
    for context in config.contexts:
        caches = [KVCache() for _ in models]
        for model, cache in zip(models, caches):
            model.prefill(ids[:context], cache)
        times: dict[tuple[int, int], list[float]] = {(m, n): [] for m in range(2) for n in config.widths}
        for repeat in range(config.warmup + config.repeats):
            for n in config.widths:
                tokens = torch.tensor([ids[context:context + n]])
                for m in ((0, 1) if repeat % 2 == 0 else (1, 0)):
                    seconds = _timed_forward(models[m], caches[m], tokens, context)
                    if repeat >= config.warmup:
                        times[m, n].append(seconds)
        ref_ms = [1e3 * statistics.median(times[0, n]) for n in config.widths]
        quant_ms = [1e3 * statistics.median(times[1, n]) for n in config.widths]
        out["reference_ms"].append([round(t, 3) for t in ref_ms])
        out["quantized_ms"].append([round(t, 3) for t in quant_ms])
        out["ratio"].append([round(q / r, 3) for q, r in zip(quant_ms, ref_ms)])
    return out


def quant_report(reference: Target, quantized: Target, config: ReportConfig = ReportConfig()) -> dict[str, Any]:
    """The full report for `quantized` against its unquantized `reference` (JSON-ready)."""
    if reference.vocab_size != quantized.vocab_size:
        raise ValueError(f"reference vocabulary {reference.vocab_size} != quantized {quantized.vocab_size}")
    ids = eval_token_ids(reference, min(config.eval_tokens, reference.context_length))
    report: dict[str, Any] = {
        "reference": reference.name,
        "quantized": quantized.label,
        "quant": quantized.info.get("quant", {"spec": "none"}),
        "eval_text": {"id": EVAL_ID, "sha256_12": text_fingerprint(EVAL_TEXT),
                      "tokenized": reference.tokenizer is not None},
        **agreement(reference, quantized, ids),
        "config": asdict(config),
        "torch_threads": torch.get_num_threads(),
        "device": str(quantized.device),
        "confounds": [Q4_1_CONFOUND] if reference.name.startswith("smollm2-135m") else [],
    }
    if config.latency:
        report["latency"] = latency_curve(reference, quantized, config)
    return report
