"""The width effect (`specdec.measure.width_effect`): what it records, that it sees a law that moves
with the forward's width and nothing where there is none, its CI, and its bench script's record."""

import json
import math
from pathlib import Path

import pytest
import torch

import specdec
from specdec.measure import width_effect as we
from specdec.runtime.model import Target

PROMPTS = ([1, 2, 3, 4, 5], [3, 4, 1, 2], [7, 7, 7, 9])


@pytest.fixture(scope="module")
def fp64():
    return specdec.tiny_target("llama", dtype=torch.float64, seed=0, logit_scale=3.0)


def test_recorded_laws_are_the_runs_own(fp64):
    drafter = specdec.drafters.build("random", target=fp64)
    laws = we.token_laws(fp64, drafter, PROMPTS[0], shape="tree(2,2)", temperature=1.0, max_new_tokens=10, seed=3)
    out = specdec.generate(fp64, drafter, PROMPTS[0], shape="tree(2,2)", max_new_tokens=10, temperature=1.0, seed=3,
                           stop_on_eos=False)
    assert laws.tokens == out.token_ids and len(laws.logits) == 10
    assert max(laws.widths) == 1 + 6 and min(laws.widths) >= 1  # tree(2,2): root + 2 + 4 nodes
    # the first token's law is the one after the prompt
    from specdec.loop.reference import next_token_logits
    assert torch.allclose(laws.logits[0], next_token_logits(fp64, PROMPTS[0]).double(), atol=1e-9)


def test_teacher_forcing_reproduces_a_plain_run(fp64):
    plain = we.token_laws(fp64, None, PROMPTS[1], temperature=0.7, max_new_tokens=8, seed=1)
    forced = we.token_laws(fp64, None, PROMPTS[1], temperature=0.7, seed=99, force=plain.tokens)
    assert forced.tokens == plain.tokens and set(forced.widths) == {1}
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, forced.logits))
    drafted = we.token_laws(fp64, specdec.drafters.build("random", target=fp64), PROMPTS[1], force=plain.tokens)
    assert drafted.tokens == plain.tokens and max(drafted.widths) > 1  # forced through drafted steps
    assert all(torch.allclose(a, b, atol=1e-9, rtol=0) for a, b in zip(plain.logits, drafted.logits))


def test_no_width_effect_in_fp64(fp64):
    effect = we.width_effect(fp64, specdec.drafters.build("random", target=fp64), PROMPTS, tokens=8)
    summary = effect.summary()
    assert effect.exact_arithmetic and summary["max_gap_shift"] < 1e-9
    assert all(r["max_tv"] < 1e-9 and r["argmax_differs"] == 0 for r in summary["width_effect"])
    assert {r["shape"] for r in summary["width_effect"]} == {"all", *we.SHAPES}
    assert all(r["mean_width"] > 1 for r in summary["width_effect"])


def test_a_law_that_moves_with_the_width_is_measured(fp64, monkeypatch):
    """Logits of a forward wider than one row get +0.5 on token 0: the drafted run's law at every
    token decided in a wide forward differs from the plain loop's by the TV of that shift."""
    real = Target.logits

    def wide_shift(self, rows):
        logits = real(self, rows)
        if rows.shape[1] > 1:
            logits = logits.clone()
            logits[..., 0] += 0.5
        return logits

    monkeypatch.setattr(Target, "logits", wide_shift)
    drafter = specdec.drafters.build("random", target=fp64)
    effect = we.prompt_width_effect(fp64, drafter, PROMPTS[0], "chain(3)", 1.0, tokens=8)
    plain = we.token_laws(fp64, None, PROMPTS[0], temperature=1.0, seed=0, force=effect_tokens(fp64, drafter))
    for tv, shift, width, p in zip(effect.tv, effect.gap_shift, effect.widths, plain.logits):
        shifted = p.clone()
        shifted[0] += 0.5
        expected = we.total_variation(shifted, p, 1.0) if width > 1 else 0.0
        assert tv == pytest.approx(expected, abs=1e-9)
        assert shift <= 0.5 + 1e-9
    assert any(w > 1 for w in effect.widths) and effect.mean_tv > 1e-3


def effect_tokens(target, drafter):
    return we.token_laws(target, drafter, PROMPTS[0], shape="chain(3)", temperature=1.0, max_new_tokens=8).tokens


def test_mean_ci_is_a_t_interval():
    mean, lo, hi = we.mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5) and lo == 4.0 - hi
    with pytest.raises(ValueError, match="at least 2 prompts, got 1"):
        we.mean_ci([0.5])
    with pytest.raises(ValueError, match="at least 2, got 1"):
        we.width_effect(specdec.tiny_target("llama", dtype=torch.float64), None, [[1, 2]])


def test_exact_arithmetic_only_for_plain_fp32_or_fp64():
    assert we.exact_arithmetic(specdec.tiny_target("llama", dtype=torch.float32))
    assert not we.exact_arithmetic(specdec.tiny_target("llama", dtype=torch.bfloat16))


def test_bench_script_records_the_derivation(tmp_path, monkeypatch, capsys):
    from scripts import bench_width_effect as bench

    monkeypatch.setenv("SPECDEC_RECORDS", str(tmp_path))
    result = bench.main(["--target", "tiny-llama", "--dtype", "bfloat16", "--kernel", "torch", "--drafter", "random",
                         "--prompts", "2", "--tokens", "6", "--shapes", "chain(2)"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["near_tie_allowance"] == bench.NEAR_TIE_MARGIN * result["max_gap_shift"]
    assert result["dtype"] == "bfloat16" and [r["temperature"] for r in result["width_effect"]] == [0.7, 0.7, 1.0, 1.0]
    (records,) = tmp_path.glob("*.jsonl")
    assert json.loads(records.read_text().splitlines()[-1])["kind"] == "width_effect"
    with pytest.raises(SystemExit):
        bench.main(["--prompts", "1"])


def test_the_embedded_bf16_near_tie_allowance_is_the_recorded_derivation():
    """tests/test_embedded.py's bf16 allowance is the largest `near_tie_allowance` of the recorded bf16
    width-effect measurements of the embedded target (scripts/bench_width_effect.py), on any machine."""
    import ast

    from specdec.measure import records

    root = Path(__file__).resolve().parents[1]
    allowances = [r["result"]["near_tie_allowance"] for path in (root / "docs" / "measurements" / "results").glob("*.jsonl")
                  for r in records.read(path) if r["kind"] == "width_effect"
                  and r["result"]["dtype"] == "bfloat16" and r["result"]["target"] == "smollm2-135m"]
    if not allowances:
        pytest.skip("no bf16 width-effect record of smollm2-135m: run scripts/bench_width_effect.py")
    source = (root / "tests" / "test_embedded.py").read_text()
    (line,) = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", None) == "NEAR_TIE"]
    near_tie = {ast.unparse(k): ast.literal_eval(v) for k, v in zip(line.value.keys, line.value.values)}
    assert near_tie["torch.bfloat16"] == max(allowances)
