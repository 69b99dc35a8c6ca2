"""Known third-party noise at import and load time, silenced narrowly.

Owns two things and nothing else:
- `install_log_filters()`: drops exactly two harmless log lines that appear when transformers
  imports an installed torchao on a CPU machine: torchao's "Failed to load ... .so" (its optional
  CUDA/MX kernels; the CPU paths specdec uses do not need them) and torch's "... is an Enum
  subclass ... register_constant() ... deprecated" (torchao registering its enums). Every other
  record of those loggers passes. Run by `specdec/__init__.py` before anything imports transformers.
- `no_progress_bars()`: a context in which transformers shows no "Loading weights" bar (restored
  after), for loading the embedded model and other checkpoints.
Knows nothing about models, drafters or quantization.
"""

from __future__ import annotations

import logging
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
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
