"""Shared fixtures: tiny fp64 targets built from configs, the embedded target (loaded once); the hub
offline in every test; a temporary $SPECDEC_CACHE for the whole session."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from specdec import machine

# Tests never read or write the user's cache (tune records, curves), the checkout's result records
# (docs/measurements/results) nor hypothesis' storage in the checkout (./.hypothesis): the session gets its own,
# which the processes tests start inherit. The embedded model's converted copy, when the user's cache
# has one, is linked in read-only rather than converted again (a deterministic conversion, not a
# measurement); without one, the first test that needs it converts it into the temporary cache. Each
# xdist worker has a cache of its own; the user's is named by the first process, which the workers inherit.
os.environ.setdefault("SPECDEC_TEST_USER_CACHE", str(machine.cache_root()))
_USER_CACHE = Path(os.environ["SPECDEC_TEST_USER_CACHE"])
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="specdec-test-cache-"))
os.environ["SPECDEC_CACHE"] = str(_SESSION_CACHE)
os.environ["SPECDEC_RECORDS"] = str(_SESSION_CACHE / "records")  # benchmarks run by tests record here
os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = str(_SESSION_CACHE / "hypothesis")
if (_USER_CACHE / "smollm2-135m-instruct" / "model.safetensors").exists():
    (_SESSION_CACHE / "smollm2-135m-instruct").symlink_to(_USER_CACHE / "smollm2-135m-instruct")

import specdec  # noqa: E402

FAMILIES = ["llama", "qwen2", "mistral"]

# One intra-op thread: tiny models spend their time in thread hand-offs, and on a small machine with
# anything else running, 2 threads make even the embedded model's decode several times slower
# (OpenMP barriers).
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker per usable core, at most 4; each worker converts and holds
    the embedded model and compiles its own graphs, so more would cost memory and repeated setup."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_unconfigure(config):
    """The session's cache goes with the session (the user's converted model is only linked from it)."""
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(scope="session", params=FAMILIES)
def tiny64(request):
    """A tiny fp64 target per model family (vocab 64), for token-exact identity tests."""
    return specdec.tiny_target(request.param, vocab_size=64, dtype=torch.float64, seed=0, logit_scale=4.0)


@pytest.fixture(scope="session")
def tiny_llama64():
    return specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=0, logit_scale=4.0)


@pytest.fixture(scope="session")
def embedded():
    """The embedded default target, SmolLM2-135M-Instruct (fp32)."""
    return specdec.load_target("smollm2-135m")


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch):
    """No test asks the Hugging Face hub: a hub id fails at once, instead of reaching the real hub where
    there is a network or retrying an unreachable host (~20 s a file) where there is none.
    huggingface_hub and datasets read HF_HUB_OFFLINE once, at import: the variable reaches only the
    processes a test starts, and this process needs their flags set."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    try:
        import datasets.config
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
