"""specdec: speculative decoding research with one exact verifier.

Public API:
    target = specdec.load_target("smollm2-135m")
    drafter = specdec.drafters.build("ngram", target=target)
    out = specdec.generate(target, drafter, "Why is the sky blue?", shape="chain(4)")
"""

from specdec import drafters
from specdec.loading import load_target, tiny_target
from specdec.loop import GenerationOutput, generate
from specdec.metrics import GenerationStats
from specdec.models import Target
from specdec.profile import profile
from specdec.sampling import SamplingConfig
from specdec.shapes import ChainShape, DynamicShape, TreeShape, parse_shape

__all__ = [
    "ChainShape", "DynamicShape", "GenerationOutput", "GenerationStats", "SamplingConfig", "Target",
    "TreeShape", "drafters", "generate", "load_target", "parse_shape", "profile", "tiny_target",
]
__version__ = "0.1.0"
