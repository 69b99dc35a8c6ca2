"""`python -m specdec.certify`: the certificate's text and its last line, the JSON schema of issue 12.

The power entries' detection itself is tested at full size in test_exactness.py; here 40 samples
per power case are too few on purpose, so the certificate must say FAIL and exit 1."""

import json

import pytest

from specdec import certify


def test_certificate_ends_with_one_json_line(capsys):
    status = certify.main(["random", "--shapes", "chain(2);tree(2,1)", "-n", "30", "--power-n", "40"])
    out = capsys.readouterr().out.strip().splitlines()
    record = json.loads(out[-1])
    assert set(record) == {"drafter", "cases", "min_p", "power"}
    assert record["drafter"] == "random"
    assert len(record["cases"]) == 2 * 3 * 2  # shapes x samplings x EOS off/on
    assert all(set(c) == {"shape", "sampling", "n", "p_value"} and c["n"] == 30 for c in record["cases"])
    assert record["min_p"] == min(c["p_value"] for c in record["cases"])
    assert set(record["power"]) == set(certify.WRONG_RULES)
    assert all(0 <= p <= 1 for p in record["power"].values())  # too few samples to detect: see below
    assert status == 1 and "FAIL" in out[-2] and "NOT DETECTED" in "\n".join(out)
    assert any("identical" in line for line in out)


def test_options_reach_the_drafter():
    assert certify.parse_options("max_ngram=2,quant=rtn8_pc,refresh=false") == {
        "max_ngram": 2, "quant": "rtn8_pc", "refresh": False}
    world = certify.tiny_world()
    assert certify.build_drafter("ngram", world.target, {"max_ngram": 2}).max_ngram == 2


@pytest.mark.parametrize("argv, message", [
    (["nosuch"], "unknown drafter 'nosuch'"),
    (["ngram", "--shapes", "zigzag(3)"], "cannot parse draft shape"),
    (["ngram", "--options", "oops"], "k=v pairs"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert certify.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
