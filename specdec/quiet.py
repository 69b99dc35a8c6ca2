"""Known third-party noise at import and load time, silenced narrowly: `install_log_filters()` (torchao's "Failed to
load ... .so" and torch's "register_constant() ... deprecated", nothing else) and `no_progress_bars()`
(transformers' bars, its GGUF reader's included). Knows nothing about models, drafters or quantization.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_DROPPED = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("register_constant() on Enum subclasses is deprecated",),
}


class _DropKnownNoise(logging.Filter):
    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(needle in message for needle in self.needles)


def install_log_filters() -> None:
    """Attach the filters (idempotent)."""
    for name, needles in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
            logger.addFilter(_DropKnownNoise(needles))


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Hide transformers' progress bars (e.g. "Loading weights") inside the block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_reader = sys.modules.get("transformers.modeling_gguf_pytorch_utils")  # imported only with gguf
    if gguf_reader is None and _has_gguf():
        import transformers.modeling_gguf_pytorch_utils as gguf_reader
    plain_tqdm = getattr(gguf_reader, "tqdm", None)
    if plain_tqdm is not None:
        gguf_reader.tqdm = functools.partial(plain_tqdm, disable=True)
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        if plain_tqdm is not None:
            gguf_reader.tqdm = plain_tqdm


def _has_gguf() -> bool:
    import importlib.util

    return importlib.util.find_spec("gguf") is not None
