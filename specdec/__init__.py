"""specdec: speculative decoding research with one exact verifier.

Public API:
    target = specdec.load_target("smollm2-135m")
    drafter = specdec.drafters.build("ngram", target=target)
    out = specdec.generate(target, drafter, "Why is the sky blue?", shape="chain(4)")
"""

from specdec.quiet import install_log_filters

install_log_filters()  # before transformers (and through it torchao) is first imported

from specdec import drafters  # noqa: E402
from specdec.loading import load_target, tiny_target  # noqa: E402
from specdec.loop import GenerationOutput, generate  # noqa: E402
from specdec.metrics import GenerationStats  # noqa: E402
from specdec.models import Target  # noqa: E402
from specdec.profile import profile  # noqa: E402
from specdec.sampling import SamplingConfig  # noqa: E402
from specdec.shapes import ChainShape, DynamicShape, TreeShape, parse_shape  # noqa: E402

__all__ = [
    "ChainShape", "DynamicShape", "GenerationOutput", "GenerationStats", "SamplingConfig", "Target",
    "TreeShape", "drafters", "generate", "load_target", "parse_shape", "profile", "tiny_target",
]
__version__ = "0.1.0"
