"""GPTQ adapter (`gptq2` .. `gptq8`) through gptqmodel, calibrated on `specdec.quant.texts`: `gptq_config`,
`gptq_calibration` and the round trip through a temporary directory. CUDA only; the kernel-free parts test anywhere.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from specdec.quant.registry import QuantSpec, backend
from specdec.quant.texts import calibration_samples

GPTQ_BITS = (2, 3, 4, 8)


def gptq_config(spec: QuantSpec) -> dict[str, Any]:
    """Keyword arguments of `gptqmodel.QuantizeConfig` for `spec` (act-order off: static groups)."""
    return {"bits": spec.bits, "group_size": -1 if spec.group_size is None else spec.group_size,
            "sym": spec.symmetric, "desc_act": False}


def gptq_calibration(tokenizer: Any, max_tokens: int = 256) -> list[dict[str, list[int]]]:
    """The fixed calibration set as gptqmodel examples: one {input_ids, attention_mask} per paragraph."""
    return [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration_samples(tokenizer, max_tokens)]


@backend("gptq", description="GPTQ via gptqmodel, calibrated on specdec-calibration-v1, packed int kernels",
         bits=GPTQ_BITS, bits_in_name=True, grouped=True, per_channel=True, symmetric_option=True,
         default_symmetric=True, devices=("cuda",), library="gptqmodel", extra="gptq", calibrated=True)
def apply_gptq(model: nn.Module, spec: QuantSpec, tokenizer: Any) -> nn.Module:
    from gptqmodel import GPTQModel, QuantizeConfig

    device = model.get_output_embeddings().weight.device
    examples = gptq_calibration(tokenizer)
    with tempfile.TemporaryDirectory(prefix="specdec-gptq-") as tmp:
        source, packed = Path(tmp) / "source", Path(tmp) / "packed"
        model.save_pretrained(source)
        tokenizer.save_pretrained(source)
        quantizer = GPTQModel.load(str(source), QuantizeConfig(**gptq_config(spec)))
        quantizer.quantize(examples, batch_size=1)
        quantizer.save(str(packed))
        loaded = GPTQModel.load(str(packed), device=str(device))
    return loaded.model
