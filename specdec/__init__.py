"""specdec: speculative decoding research with one exact verifier.

Public API:
    target = specdec.load_target("smollm2-135m")
    drafter = specdec.drafters.build("ngram", target=target)
    out = specdec.generate(target, drafter, "Why is the sky blue?", shape="chain(4)")
"""

from specdec.quiet import install_log_filters

install_log_filters()  # before transformers (and through it torchao) is first imported

from specdec.target.loading import load_target, tiny_target  # noqa: E402
from specdec.core.loop import BatchOutput, GenerationOutput, generate, generate_batch  # noqa: E402
from specdec.core.metrics import GenerationStats  # noqa: E402
from specdec.target.model import Target  # noqa: E402
from specdec.measure.profiles import profile  # noqa: E402
from specdec.core.sampling import SamplingConfig  # noqa: E402
from specdec.core.shapes import ChainShape, DynamicShape, TreeShape, parse_shape  # noqa: E402

__all__ = [
    "BatchOutput", "ChainShape", "DynamicShape", "GenerationOutput", "GenerationStats", "SamplingConfig", "Target",
    "TreeShape", "drafters", "generate", "generate_batch", "load_target", "parse_shape", "profile", "tiny_target",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`specdec.drafters` on first use: importing the core (the loop) loads no drafter."""
    if name == "drafters":
        import importlib

        return importlib.import_module("specdec.drafters")
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
