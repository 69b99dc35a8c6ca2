"""`python -m specdec.certify`: the certificate's text and JSON line, `--self-test`, and bad drafters.

The power section at full size (every mutant caught at p <= 1e-6) is tested in test_exactness.py;
here 20 or 40 samples per reference case are too few on purpose, so the certificate must say FAIL."""

import json

import pytest
import torch

from specdec import certify
from specdec.core.draft import Draft
from specdec.drafters.registry import _REGISTRY, build
from specdec.certify.mutants import MUTANTS


def test_certificate_ends_with_one_json_line(capsys):
    status = certify.main(["random", "--shapes", "chain(2);tree(2,1)", "-n", "30", "--power-n", "20",
                           "--target", "tiny-llama", "--dtype", "bfloat16", "--width-prompts", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    assert set(record) == {"drafter", "passed", "verdict", "cases", "batch", "min_p", "power", "width", "promise",
                           "cpu_seconds", "detectable_tv", "failure"}
    assert record["drafter"] == "random" and record["passed"] is False and record["verdict"] == "FAIL"
    # random batches: one batched case per shape and sampling (greedy, top-k, top-p), each row against
    # its own prompt's law or greedy reference
    assert [(c["shape"], c["sampling"]) for c in record["batch"]] == [
        (shape, sampling) for shape in ("chain(2)", "tree(2,1)") for sampling in ("greedy", "top-k", "top-p")]
    assert all(c["prompt"] == "batch of 3" and c["problem"] is None for c in record["batch"])
    # the width effect on the bf16 target: TV per token with a CI, per temperature
    width = record["width"]
    assert width["dtype"] == "bfloat16" and width["exact_arithmetic"] is False and width["prompts"] == 2
    assert [r["temperature"] for r in width["width_effect"]] == [0.7, 1.0]
    assert all(r["ci_low"] <= r["tv_per_token"] <= r["ci_high"] for r in width["width_effect"])
    assert "verification width" in record["promise"] and any(line.startswith("Promise: ") for line in out)
    assert any(line.startswith("Width effect on tiny-llama (bfloat16") for line in out)
    # shapes x samplings x EOS off/on, shapes x samplings on the branch prompt, the coverage cases
    assert len(record["cases"]) == 2 * 3 * 2 + 2 * 3 + len(certify.COVERAGE)
    assert all(c["n"] == 30 and c["problem"] is None for c in record["cases"])
    assert {c["cache"] for c in record["cases"]} == {"dynamic", "static", "graphs"}
    assert any(c["shape"] == "auto" for c in record["cases"])
    assert any(c["draft_p"] is not None for c in record["cases"])  # random's sampled chains are checked
    assert record["min_p"] == min(min(c["p_value"], c["draft_p"] or 1.0) for c in record["cases"] + record["batch"])
    assert set(record["power"]["mutants"]) == {m.name for m in MUTANTS}
    assert status == 1 and "FAIL" in out[-2] and "NOT CAUGHT" in "\n".join(out)
    # the FAIL line names what failed with its own p: a mutant the 20-sample reference cases miss
    failed = record["failure"]
    assert out[-2].startswith(f"FAIL: {failed}; min p = ") and failed.startswith("mutant '")
    name = failed.split("'")[1]
    assert f"(p = {record['power']['mutants'][name]:.3g} > 1e-06)" in failed
    # 30 generations per case detect no tilt up to TV 1 / V = 0.2 per token with power 0.99
    assert record["detectable_tv"] is None and record["power"]["detectable_tv"] is None
    assert "detectable TV inf per token" in out[-2]
    assert any("identical" in line for line in out)


def test_self_test_prints_control_and_every_mutant(capsys):
    status = certify.main(["--self-test", "--power-n", "40"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(record) == {"control", "mutants", "detectable_tv", "planted_p", "cpu_seconds"}
    # stated for the default 250 generations per case, and checked once through the real verifier
    assert 0 < record["detectable_tv"] < 0.2 and record["planted_p"] < certify.ALPHA
    assert set(record["mutants"]) == {m.name for m in MUTANTS}
    assert record["control"] >= certify.ALPHA
    # Gross errors are caught even at 40 samples; the subtle ones need the full size (test_exactness).
    assert record["mutants"]["always_accept"] <= certify.POWER_ALPHA
    assert record["mutants"]["greedy_at_temperature"] <= certify.POWER_ALPHA
    # the greedy siblings case is exact (p = 0 or 1) at any size: the position and keep mutants fail it
    assert record["mutants"]["tree_positions_in_chain"] == record["mutants"]["keep_ignores_path"] == 0.0
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
    assert f"{shape} top-k" in text and "FAILED: " in text
    named = (f"FAIL: greedy identity {shape}: {cert.greedy[shape]} (p = 0); " if cert.greedy[shape] else
             f"FAIL: case '{failed[0].label}': {failed[0].problem} (p = 0 < 0.0001); ")
    assert text.splitlines()[-1].startswith(named)
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


def _certificate(width_exact: bool | None, algorithm_exact: bool = True) -> certify.Certificate:
    """A certificate with made-up results: cases at p = 0.5, a power section whose mutants are all
    caught (or, algorithm_exact False, one not caught), and a width effect (None: no --target)."""
    from specdec.certify.cases import CaseResult
    from specdec.measure.width_effect import PromptEffect, WidthEffect

    case = CaseResult("chain(2)", "plain", False, 100, 0.5)
    caught = {m.name: [CaseResult("tree(3)", "plain", False, 100, 0.0 if algorithm_exact or i else 0.5)]
              for i, m in enumerate(MUTANTS)}
    cert = certify.Certificate("random", {}, {"chain(2)": None}, [case], None, certify.Power([case], caught))
    if width_exact is not None:
        effects = [PromptEffect("chain(4)", t, [0.01 * (i + 1)] * 4, [0.1] * 4, 0, [5] * 4, prompt=i)
                   for i in range(3) for t in (0.7, 1.0)]
        cert.width = WidthEffect("smollm2-135m", "bfloat16", "torch", "none", "random", 4, 3, effects, width_exact)
    return cert


@pytest.mark.parametrize("width_exact, algorithm_exact, verdict", [
    (None, True, "PASS"), (True, True, "PASS"), (False, True, "WIDTH-DEPENDENT"), (False, False, "FAIL"),
    (None, False, "FAIL"),
])
def test_a_width_dependent_target_gets_no_pass(width_exact, algorithm_exact, verdict):
    cert = _certificate(width_exact, algorithm_exact)
    assert cert.verdict == verdict and cert.passed == (verdict == "PASS")
    text = cert.text()
    last = text.splitlines()[-1]
    if verdict == "FAIL":  # the mutant that was not caught, with its own p (the cases' min p is 0.5)
        assert last.startswith(f"FAIL: mutant {MUTANTS[0].name!r} not caught (p = 0.5 > 1e-06); min p = 0.5")
    else:
        assert last.startswith(f"{verdict}: min p = 0.5, detectable TV ")
    assert f"Promise: {certify.PROMISE}." in text
    assert ("TV per token 0.02 [" in text) == (width_exact is not None)  # mean over 3 prompts of 0.01, 0.02, 0.03
    if verdict == "WIDTH-DEPENDENT":
        assert "no PASS" in text.splitlines()[-1]
    assert json.loads(cert.json_line())["verdict"] == verdict


def test_a_drafter_that_cannot_batch_gets_a_line_not_a_failure():
    world = certify.tiny_world()
    drafter = certify.SiblingDrafter(certify.VOCAB, width=2, depth=1)
    assert not getattr(drafter, "batchable", False)
    assert certify.batch_cases(world, drafter, 5) is None
    cert = _certificate(None)
    assert cert.batch is None and cert.passed
    assert "does not batch (generate_batch refuses it); no batched case (not a failure)" in cert.text()


# ---- the world sees positions ------------------------------------------------------------------------


@torch.no_grad()
def test_the_world_moves_with_a_token_moved_by_one_position():
    """On every model of the certificate's world but the random draft model and the flat target, moving
    the last token of a context by 1, 3 or 6 positions flips the argmax in most of 60 contexts and moves
    the next-token law by TV > 0.3 on average (a random tiny model: no flip, TV <= 0.001)."""
    world = certify.tiny_world()
    for target in (*world.greedy_targets, world.target):
        g = torch.Generator().manual_seed(1)
        flips, tv = 0, 0.0
        for _ in range(60):
            length = int(torch.randint(6, 14, (), generator=g))
            ids = torch.randint(0, target.vocab_size, (1, length), generator=g)
            positions = torch.arange(length)[None]
            base = target.model(input_ids=ids, position_ids=positions).logits[0, -1]
            for shift in (1, 3, 6):
                moved = positions.clone()
                moved[0, -1] += shift
                logits = target.model(input_ids=ids, position_ids=moved).logits[0, -1]
                flips += int(logits.argmax() != base.argmax())
                tv += 0.5 * float((logits.softmax(-1) - base.softmax(-1)).abs().sum()) / 180
        assert flips > 0.6 * 180 and tv > 0.3, (target.vocab_size, flips, tv)


def test_a_batch_row_at_the_stored_length_fails_the_greedy_batched_case():
    """The `batch_rows_at_stored_length` mutant (every row at the shared stored length) makes the greedy
    batched case name the rows that differ; unmutated it passes."""
    from specdec.certify.batch import batch_case
    from specdec.certify.mutants import mutant, mutated

    world = certify.tiny_world()
    target = world.greedy_targets[0]
    case = batch_case(target, build("random", target=target), "tree(2,2)", "greedy", 1)
    assert case.problem is None and case.p_value == 1.0 and case.steps > 0
    with mutated(mutant("batch_rows_at_stored_length")):
        case = batch_case(target, build("random", target=target), "tree(2,2)", "greedy", 1)
    assert case.p_value == 0.0 and case.problem.startswith("rows [") and "differ from the greedy reference" in case.problem


@pytest.mark.slow
def test_the_certificate_runs_on_the_compiled_path():
    """Issue 53's must-show, its fast subset: greedy identity and a distribution case, each on the
    `compiled` forward (torch.compile of the static-shape forward, tiny fp64 models)."""
    cert = certify.certify("ngram", shapes=("chain(2)",), n=60, samplings=("plain",), eos=(False,), power_n=0,
                           greedy_shapes=("chain(4)",), coverage=False, batch_n=0, cache="compiled",
                           buckets=(16,))  # one compile per model
    assert cert.greedy == {"chain(4)": None} and "cache 'compiled'" in cert.text()
    assert [(c.cache, c.problem) for c in cert.cases] == [("compiled", None)] * 2
    assert cert.min_p >= certify.ALPHA and cert.failure() == "no power section (--power-n 0)"
