"""specdec: speculative decoding research with one exact verifier.

    out = specdec.generate(specdec.load_target("smollm2-135m"), None, "Why is the sky blue?")

The face is lazy (PEP 562): `import specdec` loads no submodule; each name below loads its module on first use.
"""

from specdec.quiet import install_log_filters

install_log_filters()  # before transformers (and through it torchao) is first imported

_FACE = {
    "load_target": "specdec.loading", "tiny_target": "specdec.loading",
    "BatchOutput": "specdec.loop.decode", "GenerationOutput": "specdec.loop.decode",
    "generate": "specdec.loop.decode", "generate_batch": "specdec.loop.decode",
    "decode": "specdec.loop.decode", "DecodeConfig": "specdec.loop.decode", "StepEvent": "specdec.core.events",
    "GenerationStats": "specdec.core.metrics", "Target": "specdec.runtime.model",
    "profile": "specdec.measure.profiles", "SamplingConfig": "specdec.core.sampling",
    "ChainShape": "specdec.core.shapes", "DynamicShape": "specdec.core.shapes", "TreeShape": "specdec.core.shapes",
    "parse_shape": "specdec.core.shapes",
}
_MODULES = ("drafters", "quant", "tune", "certify", "machine")

__all__ = sorted([*_FACE, "drafters"])
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name's module on first use (then cached in this module's namespace)."""
    import importlib

    if name in _FACE:
        value = getattr(importlib.import_module(_FACE[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"specdec.{name}")
    else:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_FACE, *_MODULES])
