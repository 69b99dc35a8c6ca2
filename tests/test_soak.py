"""scripts/soak.py for a few seconds: it decodes, samples the resident set, and its last line is the
JSON summary whose growth and verdict follow from its own samples."""

import json
import mmap

import pytest

from scripts import soak


def test_a_short_soak_ends_with_its_json_summary(capsys):
    returned = soak.main(["--minutes", "0.05", "--every", "0.5"])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result == returned and lines[0].startswith("soak: tiny-llama, 0.05 min")
    assert {"samples", "rss_warm_mb", "rss_end_mb", "growth_pct", "passed"} <= result.keys()
    assert result["batches"] >= 1 and result["samples"] >= 2  # the start and the end at least
    assert 0 < result["rss_start_mb"] and 0 < result["rss_warm_mb"] <= result["rss_max_mb"]
    assert result["rss_end_mb"] <= result["rss_max_mb"]
    growth = 100 * (result["rss_end_mb"] - result["rss_warm_mb"]) / result["rss_warm_mb"]
    assert result["growth_pct"] == pytest.approx(growth, abs=0.05)  # from the rounded MiB
    assert result["max_growth_pct"] == 5.0 and result["passed"] is (result["growth_pct"] <= 5.0)


def test_resident_memory_is_read_in_mib_and_follows_an_allocation():
    before = soak.rss_mb()
    block = mmap.mmap(-1, 64 * 2**20)  # fresh pages from the kernel, not memory the allocator already holds
    block[:: 4096] = b"\x01" * len(block[:: 4096])  # touch every page so it is resident
    assert soak.rss_mb() - before >= 60
    del block
