"""`python -m specdec.certify`: the certificate's text and JSON line, `--self-test`, and bad drafters.

The power section at full size (every mutant caught at p <= 1e-6) is tested in test_exactness.py;
here 20 or 40 samples per reference case are too few on purpose, so the certificate must say FAIL."""

import json

import pytest
import torch

from specdec import certify
from specdec.core.draft import Draft
from specdec.drafters.registry import _REGISTRY, build
from specdec.measure.mutants import MUTANTS


def test_certificate_ends_with_one_json_line(capsys):
    status = certify.main(["random", "--shapes", "chain(2);tree(2,1)", "-n", "30", "--power-n", "20"])
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    assert set(record) == {"drafter", "passed", "cases", "min_p", "power", "cpu_seconds"}
    assert record["drafter"] == "random" and record["passed"] is False
    # shapes x samplings x EOS off/on, shapes x samplings on the branch prompt, the coverage cases
    assert len(record["cases"]) == 2 * 3 * 2 + 2 * 3 + len(certify.COVERAGE)
    assert all(c["n"] == 30 and c["problem"] is None for c in record["cases"])
    assert {c["cache"] for c in record["cases"]} == {"dynamic", "static", "graphs"}
    assert any(c["shape"] == "auto" for c in record["cases"])
    assert any(c["draft_p"] is not None for c in record["cases"])  # random's sampled chains are checked
    assert record["min_p"] == min(min(c["p_value"], c["draft_p"] or 1.0) for c in record["cases"])
    assert set(record["power"]["mutants"]) == {m.name for m in MUTANTS}
    assert status == 1 and "FAIL" in out[-2] and "NOT CAUGHT" in "\n".join(out)
    assert any("identical" in line for line in out)


def test_self_test_prints_control_and_every_mutant(capsys):
    status = certify.main(["--self-test", "--power-n", "40"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(record) == {"control", "mutants", "cpu_seconds"}
    assert set(record["mutants"]) == {m.name for m in MUTANTS}
    assert record["control"] >= certify.ALPHA
    # Gross errors are caught even at 40 samples; the subtle ones need the full size (test_exactness).
    assert record["mutants"]["always_accept"] <= certify.POWER_ALPHA
    assert record["mutants"]["greedy_at_temperature"] <= certify.POWER_ALPHA
    assert status == (0 if max(record["mutants"].values()) <= certify.POWER_ALPHA else 1)


def test_options_reach_the_drafter():
    assert certify.parse_options("max_ngram=2,quant=rtn8_pc,refresh=false") == {
        "max_ngram": 2, "quant": "rtn8_pc", "refresh": False}
    world = certify.tiny_world()
    assert certify.build_drafter("ngram", world.target, {"max_ngram": 2}).max_ngram == 2


@pytest.mark.parametrize("argv, message", [
    (["nosuch"], "unknown drafter 'nosuch'"),
    ([], "name a drafter"),
    (["ngram", "--shapes", "zigzag(3)"], "cannot parse draft shape"),
    (["ngram", "--options", "oops"], "k=v pairs"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert certify.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# ---- drafters that break the contract: a FAIL naming the case, never a crash or a PASS ----------


class Broken:
    """The `random` drafter with one defect (`how`) in the drafts it returns."""

    name = "broken"

    def __init__(self, *, target, how: str):
        self.inner, self.how = build("random", target=target), how

    def reset(self):
        self.inner.reset()

    def commit(self, step):
        pass

    def propose(self, request):
        if self.how == "chains only" and not isinstance(request.shape, certify.specdec.core.shapes.ChainShape):
            raise ValueError(f"broken drafts chains only, not {request.shape}")
        draft = self.inner.propose(request)
        probs = draft.draft_probs
        if self.how == "too deep":
            return Draft(torch.cat([draft.tokens, draft.tokens[:, :1]], 1),
                         torch.cat([draft.parents, torch.tensor([draft.num_nodes - 1])]))
        if probs is None or self.how == "chains only":
            return draft
        if self.how == "wrong shape":
            probs = torch.cat([probs, probs[..., :1]], -1)  # [B, N, V + 1]
        elif self.how == "not a distribution":
            probs = probs * 0.9
        elif self.how == "missing":  # the sampled token's mass recorded on the next token instead
            probs = probs.clone()
            rows, columns = torch.arange(draft.num_nodes), draft.tokens[0]
            probs[0, rows, (columns + 1) % probs.shape[-1]] += probs[0, rows, columns]
            probs[0, rows, columns] = 0.0
        elif self.how == "point-mass":
            probs = None
        return Draft(draft.tokens, draft.parents, probs)


@pytest.mark.parametrize("how, shape, expect", [
    ("wrong shape", "chain(2)", "draft_probs has shape (1, 2, 6), expected [B, N, V] = [1, 2, 5]"),
    ("not a distribution", "chain(2)", "sum to 0.9"),
    ("missing", "chain(2)", "whose recorded draft probability is 0"),
    ("too deep", "chain(2)", "asked for chain(2), the drafter returned 3 nodes"),
    ("chains only", "tree(2,2)", "ValueError: broken drafts chains only, not tree(2,2)"),
])
def test_a_broken_drafter_fails_its_certificate_naming_the_case(monkeypatch, how, shape, expect):
    monkeypatch.setitem(_REGISTRY, "broken", lambda *, target, how=how: Broken(target=target, how=how))
    cert = certify.certify("broken", shapes=(shape,), n=20, samplings=("top-k",), eos=(False,), power_n=0,
                           greedy_shapes=(shape,), coverage=False)
    assert not cert.passed
    failed = [c for c in cert.cases if c.problem]
    assert failed and all(expect in c.problem for c in failed), [c.problem for c in cert.cases]
    assert cert.min_p == 0.0
    text = cert.text()
    assert f"{shape} top-k" in text and "FAILED: " in text and "FAIL: min p = 0" in text
    if how == "chains only":
        assert "ValueError" in cert.greedy[shape]


def test_a_sampled_draft_recorded_as_point_mass_is_still_exact(monkeypatch):
    """Without draft_probs the verifier treats sampled tokens as point-mass proposals, which is exact
    whatever chose them (only accepted less often): the cases pass."""
    monkeypatch.setitem(_REGISTRY, "broken", lambda *, target: Broken(target=target, how="point-mass"))
    cert = certify.certify("broken", shapes=("chain(2)",), n=200, samplings=("top-k",), eos=(False,), power_n=0,
                           greedy_shapes=("chain(2)",), coverage=False)
    assert all(c.problem is None and c.draft_p is None for c in cert.cases)
    assert cert.min_p >= certify.ALPHA and cert.cases[0].rejections > 0
    assert not cert.passed and "skipped" in cert.text()  # no power section, no PASS
