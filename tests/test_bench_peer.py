"""scripts/bench_peer.py without its optional peer: one line saying so, exit status 0."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="the peer is installed here")
def test_without_the_peer_it_says_so_in_one_line_and_exits_0():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "scripts/bench_peer.py"], cwd=root, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.splitlines() == ["bench_peer: llama-cpp-python is not installed (pip install -e '.[peer]'); "
                                        "nothing to compare"]
