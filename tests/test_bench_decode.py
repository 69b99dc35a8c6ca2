"""experiments.decode_speed (scripts/bench_decode.py): its HF baseline decodes by the same rule as our plain loop, and bad
arguments fail before anything is loaded or generated."""

import pytest
import torch

import specdec
from experiments import decode_speed as bench_decode


@pytest.mark.parametrize("options", [{}, {"prompt_lookup_num_tokens": 3}], ids=["generate", "prompt_lookup"])
def test_hf_baseline_equals_plain_loop_through_eos(options):
    """The baseline must not suppress EOS (`min_new_tokens` did: on retrieval prompts HF then took the
    runner-up where EOS was the argmax, and matched our loop on 1 of 6 prompts). Make a token the
    plain loop emits mid-output the model's EOS: both must still give the same tokens."""
    target = specdec.tiny_target("llama", dtype=torch.float32, seed=0, logit_scale=4.0)
    ids = target.encode_prompt("the cat sat on the mat", chat=False)
    plain = specdec.generate(target, None, ids, shape="chain(1)", max_new_tokens=12, stop_on_eos=False).token_ids
    eos = plain[3]
    target.model.generation_config.eos_token_id = eos
    target.model.generation_config.pad_token_id = eos
    assert bench_decode.hf_generate(target, ids, 12, **options) == plain


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_names_the_device():
    with pytest.raises(SystemExit, match="--device: device 'cuda:1' requested but CUDA is not available"):
        bench_decode.parse(["--device", "cuda:1", "--model", "tiny-llama"])


def test_first_difference_names_the_token_where_outputs_part():
    assert bench_decode.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench_decode.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench_decode.first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: parts where it ends


def test_drafter_specs_carry_options_and_a_bad_spec_fails_before_loading():
    from specdec.drafters.registry import parse_specs

    assert parse_specs("eagle, eagle[head_dtype=bfloat16,draft_vocab=8192],ngram") == [
        ("eagle", {}), ("eagle", {"head_dtype": "bfloat16", "draft_vocab": 8192}), ("ngram", {})]
    with pytest.raises(SystemExit, match=r"--drafters: .*k=v pairs.*'oops'"):
        bench_decode.parse(["--drafters", "eagle[oops]", "--model", "tiny-llama"])
    with pytest.raises(SystemExit, match=r"--drafters: a drafter is NAME or NAME\[k=v,...\], got 'eagle\[x=1'"):
        bench_decode.parse(["--drafters", "eagle[x=1", "--model", "tiny-llama"])


def test_by_category_compares_auto_with_plain_and_the_fastest_fixed_shape_per_category(tmp_path):
    def rates(*per_prompt):
        return {"per_prompt": list(per_prompt)}

    got = {"plain": rates(10, 10, 10, 10), "ngram chain(4)": rates(12, 14, 20, 8), "ngram dynamic": rates(15, 13, 9, 9),
           "ngram auto": rates(15, 14, 9.5, 9)}
    table = bench_decode.by_category(got, ["code", "code", "chat", "chat"])
    code, chat = table
    assert (code["category"], code["best_fixed"], code["prompts"]) == ("code", "dynamic", 2)  # 28 > 26 tok/s
    assert code["vs_plain"][0] == pytest.approx(1.45) and code["vs_best_fixed"][0] == pytest.approx((1 + 14 / 13) / 2)
    assert code["never_slower"]
    assert chat["best_fixed"] == "chain(4)" and chat["vs_plain"][0] == pytest.approx(0.925)
    assert not chat["never_slower"]  # auto below plain in this category
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"category": "{c}", "turns": ["{c}{i}"]}}\n' for c in ("a", "b") for i in range(3)))
    assert bench_decode.load_prompts(str(prompts), 2, per_category=True) == [
        ("a", "a0"), ("a", "a1"), ("b", "b0"), ("b", "b1")]
    assert bench_decode.load_prompts(str(prompts), 2) == ["a0", "a1"]
