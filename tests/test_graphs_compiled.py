"""The compiled decode path (`cache="compiled"`) on a reduced-precision kernel: exact to itself.

At T = 0 the drafted output equals the plain loop's output *on the same compiled program* (both run at
the one width bucket, so every forward is the same kernel at the same width), in fp32, torchao int4 with
int8 rows (bf16 activations), the same weights on specdec's own kernels (`native_int4h8`) and torchao int8 x int8 (whose compiled program is another kernel than its eager one:
exact to itself, not to eager)."""

import pytest
import torch

import specdec
from specdec import tune
from specdec.drafters import build

PROMPT = [3, 17, 5, 9, 22, 5, 9, 22, 5, 9]


@pytest.mark.parametrize("quant", [None, *(pytest.param(q, marks=pytest.mark.slow) for q in ("torchao_int4h8", "native_int4h8", "torchao_w8a8"))])
def test_compiled_greedy_is_exact_to_its_own_kernel(quant):
    if quant and not specdec.quant.availability(quant).ok:
        pytest.skip(f"{quant} cannot run here")
    target = specdec.load_target("tiny-llama", quant=quant, kernel="torch", threads=1)
    out = {(name, cache): specdec.generate(target, None if name == "none" else build(name, target=target), PROMPT,
                                           shape="chain(4)", max_new_tokens=12, stop_on_eos=False, cache=cache,
                                           buckets=(8,) if cache == "compiled" else None).token_ids
           for name, cache in (("none", "compiled"), ("ngram", "compiled"), ("none", "dynamic"))}
    assert out["ngram", "compiled"] == out["none", "compiled"]  # drafted = plain on the compiled program
    assert torch._dynamo.config.recompile_limit >= 1024  # more targets than 4 (2 programs each) stay compiled
    if quant is None:  # fp32: the compiled program's greedy text is the eager loop's too
        assert out["none", "compiled"] == out["none", "dynamic"]


@pytest.mark.slow
def test_tune_markdown_times_eager_against_compiled(tmp_path, capsys):
    """`tune --markdown`: eager and compiled 1- and 8-token forwards with their ratios to the memory limit."""
    page = tmp_path / "page.md"
    assert tune.main(["tiny-llama", "--threads", "1", "--markdown", str(page)]) == 0
    text = page.read_text()
    assert text in capsys.readouterr().out  # printed as well as written
    row = next(line for line in text.splitlines() if line.startswith("| tiny-llama |")).split("|")[1:-1]
    assert len(row) == 9 and all(cell.strip().endswith("x)") for cell in row[3:7])
    assert "`python -m specdec.tune tiny-llama --threads 1 --markdown" in text and " family " in text
