"""The KV regime map (experiments/kv_regime.py) end to end on a tiny llama: a 2-cell map, both cells
predicted before they are timed, the last line's JSON shape, and the map drawn."""

import json

import pytest
import torch

import specdec
from experiments import kv, kv_regime


def test_the_regime_map_predicts_each_cell_before_timing_it(tmp_path, monkeypatch):
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=1)
    items = [{"id": f"p{i}", "kind": "k", "tokens": [(7 * i + j) % 60 + 2 for j in range(20)]} for i in range(3)]
    events = []
    timed = kv_regime.time_cell
    monkeypatch.setattr(kv_regime, "time_cell", lambda *a, **k: events.append("timed") or timed(*a, **k))
    log = lambda line: events.append(line)  # noqa: E731
    out = kv_regime.run_regime(target, items, {("window", 0.5): 0.7, ("snapkv", 0.25): 0.5}, tmp_path / "r",
                               batches=(1, 2), contexts=(8, 40), map_batches=(1, 2), map_contexts=(32,),
                               cells=((1, 32),), new_tokens=4, physics=(2, 32), log=log)
    json.dumps(out)
    assert set(out) == {"cells", "map", "median_abs_error"} and len(out["cells"]) == 2
    assert {(c["batch"], c["context"]) for c in out["cells"]} == {(1, 32), (2, 32)}
    for c in out["cells"]:
        assert set(c) == {"batch", "context", "policy", "retention", "predicted", "measured", "ci"}
        assert c["predicted"] > 0 and c["measured"] > 0 and c["ci"][0] <= c["ci"][1]
    predicted = [i for i, e in enumerate(events) if e.startswith("cell batch")]
    assert [events[i + 1] for i in predicted] == ["timed", "timed"]  # the prediction is printed first
    assert any(e.startswith("physics at batch 2 x 32") for e in events)
    assert (tmp_path / "r" / "kv_regime.png").stat().st_size > 0 and "| window | 50% | 2 |" in events[0]
    assert out["median_abs_error"] >= 0
    surf = json.loads((tmp_path / "r" / "kv_regime.json").read_text())["surface"]
    assert {k: len(v) for k, v in surf["overhead"].items()} == {"plain": 2, "spec": 2}
    assert any(e.startswith("Loop cost per step") for e in events[0].splitlines())


def test_shared_prefill_serves_a_batch_its_entries_once(monkeypatch):
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=1)
    rows, calls = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]], []
    shared = kv.shared_prefill(target)
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(a[0].shape) or forward(*a, **k))
    outs = [specdec.generate_batch(shared, None, rows, max_new_tokens=3, stop_on_eos=False, cache="dynamic",
                                   chat=False) for _ in range(2)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert sum(1 for s in calls if s[1] == 4) == 1  # the 4-token prefill ran once


def test_a_flat_width_curve_prices_verification_as_a_plain_step():
    from specdec.core.curve import LatencyCurve

    surf = {"batches": [1], "contexts": [8, 64], "plain": [[1.0, 2.0]], "draft": [[0.1, 0.2]],
            "verify": [[3.0, 6.0]], "commit": [[0.05, 0.1]]}
    flat = LatencyCurve(target="t", device="cuda", dtype="float16", machine="gpu", threads=1, widths=(1, 8),
                        contexts=(64,), seconds=((1.0, 1.0),))
    tokens = 1 + 0.5 + 0.25 + 0.125 + 0.0625  # chain(4) at per-token acceptance 0.5
    assert kv_regime.predict(surf, 0.5, 1, 64, 0.125) == pytest.approx(tokens * 2.0 / (4 * 0.1 + 0.05 + 6.0))
    assert kv_regime.predict(surf, 0.5, 1, 64, 0.125, flat) == pytest.approx(tokens * 2.0 / (4 * 0.1 + 0.05 + 2.0))
    surf |= {"compact": [[0.01, 0.02]], "overhead": {"plain": [0.5], "spec": [1.0]}}  # the loop's own cost, a window's
    assert kv_regime.predict(surf, 0.5, 1, 64, 0.125, policy="window") == pytest.approx(
        tokens * 2.5 / (4 * 0.1 + 0.05 + 0.01 + 6.0 + 1.0))
    assert kv_regime.predict(surf, 0.5, 1, 64, 0.125, policy="snapkv") == pytest.approx(
        tokens * 2.5 / (4 * 0.1 + 0.05 + 6.0 + 1.0))
