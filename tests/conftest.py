"""Shared fixtures: tiny fp64 targets built from configs, and the embedded target (loaded once)."""

import os

import pytest
import torch

import specdec

FAMILIES = ["llama", "qwen2", "mistral"]

# Tiny models spend their time in thread hand-offs, not arithmetic: one intra-op thread makes them
# ~10x faster on this 2-core machine. Fixtures for real models raise it while they run.
torch.set_num_threads(1)


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


@pytest.fixture()
def all_threads():
    """Use every core while a test runs the embedded model."""
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(1)
