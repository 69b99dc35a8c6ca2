"""The self-draft family: exactness for every KV policy and knob, bad input, the embedded target.

- T = 0: output == the cacheless reference for each KV policy, with `weights=` and with
  `layers=first(k)`, under chain, static tree and dynamic shapes (tiny fp64 models);
- T > 0: the chi-square test of `test_exactness` for a lossy policy per shape and knob;
- every malformed option is refused by the factory with a message naming what would work;
- the embedded target: the issue's four configurations reproduce plain greedy decoding.
"""

import pytest
import torch

import specdec
from specdec.drafters import build
from specdec.drafters.kv_policy import fake_quantize, parse_kv_policy
from specdec.loop.reference import next_token_logits, reference_generate
from specdec.certify import ALPHA, distribution_case

SHAPES = ["chain(4)", "tree(3,2,2)", "dynamic(top_k=3,depth=5,budget=12)"]
POLICIES = ["full", "window(sink=2,recent=5)", "snapkv(budget=6,window=2)", "quant(bits=2)",
            "quant(bits=4,group=4)", "window(sink=1,recent=4)+quant(bits=8)"]
KNOBS = [{}, {"weights": "rtn8_pc"}, {"layers": "first(1)"}]
PROMPT = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 2, 3, 5]


@pytest.mark.parametrize("kv", POLICIES)
@pytest.mark.parametrize("knob", KNOBS, ids=["target", "weights", "layers"])
def test_greedy_output_equals_reference(tiny_llama64, kv, knob):
    """(The registry-wide tests run a lossy composite on every model family.)"""
    ref = reference_generate(tiny_llama64, PROMPT, max_new_tokens=20, stop_on_eos=False)
    drafter = build("self_draft", target=tiny_llama64, kv=kv, **knob)
    for shape in SHAPES:
        out = specdec.generate(tiny_llama64, drafter, PROMPT, shape=shape, max_new_tokens=20, stop_on_eos=False)
        assert out.token_ids == ref, f"self_draft kv={kv} {knob} {shape} diverged from greedy"


def test_the_full_policy_with_the_targets_weights_is_always_right(tiny_llama64):
    """Same weights, exact KV: the draft is the target, so a chain is accepted whole (point masses)."""
    out = specdec.generate(tiny_llama64, build("self_draft", target=tiny_llama64), PROMPT, shape="chain(4)",
                           max_new_tokens=20, stop_on_eos=False)
    assert out.stats.mean_acceptance_length == pytest.approx(20 / 4)


# Three cases cover every policy, both knobs and the three shapes; 1000 samples each of the first 3
# tokens with `specdec.certify`'s harness (its power case rejects each wrong rule at p < 1e-10 by
# 500 samples).
CASES = {
    "window, chain": ("chain(2)", {"kv": "window(sink=1,recent=2)"}),
    "snapkv + quant(2) + weights, static tree": ("tree(2,2)", {"kv": "snapkv(budget=3,window=1)+quant(bits=2)",
                                                                "weights": "rtn8_pc"}),
    "window + quant(4) + early exit, dynamic": ("dynamic(top_k=2,depth=3,budget=5)",
                                                {"kv": "window(sink=1,recent=2)+quant(bits=4)", "layers": "first(1)"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_matches_the_target_distribution(small_world, case):
    shape, options = CASES[case]
    drafter = build("self_draft", target=small_world, **options)
    result = distribution_case(small_world, drafter, shape, "plain", n=1000, prompt=(1, 2, 3, 4, 0, 1))
    assert result.p_value >= ALPHA, f"{case}: chi-square p = {result.p_value:.2e} < {ALPHA}"


@pytest.fixture(scope="module")
def small_world():
    """A tiny target with a 5-token vocabulary (as in test_exactness), 2 layers."""
    return specdec.tiny_target("llama", vocab_size=5, hidden_size=16, dtype=torch.float64, seed=0, logit_scale=6.0)


@pytest.mark.parametrize("options, message", [
    ({"kv": "lru(size=4)"}, "unknown KV policy 'lru"),
    ({"kv": "window(sink=4,recent=)"}, "malformed KV policy"),
    ({"kv": "window(sink=4,size=8)"}, "name in \\['sink', 'recent'\\]"),
    ({"kv": "window(sink=4"}, "unknown KV policy"),
    ({"kv": ""}, "non-empty string"),
    ({"kv": "window(sink=256,recent=300)"}, "exceeds the context length 512"),
    ({"kv": "quant(bits=3)"}, "bits must be one of \\[2, 4, 8\\]"),
    ({"kv": "quant(bits=4,group=3)"}, "group 3 does not divide head_dim 8; use one of \\[1, 2, 4, 8\\]"),
    ({"kv": "snapkv(budget=4,window=8)"}, "budget >= window"),
    ({"layers": "first(0)"}, "selects no layers"),
    ({"layers": "first(3)"}, "more than the layers: the target has 2"),
    ({"layers": "middle"}, "use 'all' or 'first\\(k\\)'"),
    ({"weights": "rtn9"}, "supports bit-widths"),
    ({"weights": "gptq4"}, "cannot run on cpu"),
])
def test_bad_options_are_refused_before_generation(tiny_llama64, options, message):
    with pytest.raises(ValueError, match=message):
        build("self_draft", target=tiny_llama64, **options)


def test_policy_specs_round_trip_and_quant_error_is_bounded():
    for spec in ["full", "window(sink=4,recent=256)", "snapkv(budget=1024,window=32)", "quant(bits=4,group=32)",
                 "window(sink=4,recent=256)+quant(bits=8,group=32)"]:
        assert parse_kv_policy(spec).spec == spec
    x = torch.randn(2, 3, 5, 64, dtype=torch.float64)
    for bits in (2, 4, 8):
        q = fake_quantize(x, bits, 32)
        g = x.reshape(2, 3, 5, 2, 32)
        step = (g.amax(-1) - g.amin(-1)) / (2**bits - 1)  # [.., 2]
        assert ((q - x).abs().reshape(2, 3, 5, 2, 32) <= step[..., None] / 2 + 1e-12).all()
        levels = torch.tensor([q.reshape(-1, 32)[i].unique().numel() for i in range(30)])
        assert (levels <= 2**bits).all()


# ---- the embedded target ---------------------------------------------------------------------------
# One ordinary chat prompt, long enough (~190 tokens with the template) that every policy below
# drops entries: window(recent=64) and snapkv(budget=128) evict, quant(4) rounds every entry.
EMBEDDED_PROMPTS = ["Summarize this note for a busy colleague in three short bullet points:\n\n"
                    "Our team met on Tuesday to plan the move to the new office. The landlord confirmed that the "
                    "keys will be ready on the first of next month, but the internet line will only be installed "
                    "a week later, so for the first week everyone should keep working from home. Maria will "
                    "order the desks and chairs, and she asked that each person send her their preference for a "
                    "standing or a sitting desk by Friday. Tom is in charge of packing the shared equipment: the "
                    "printer, the two large screens and the coffee machine. He needs three volunteers for the "
                    "Saturday of the move. The budget for the move is fixed, so any extra furniture must wait "
                    "until the next quarter. Finally, the new office has fewer meeting rooms, so meetings longer "
                    "than one hour should be booked at least two days in advance through the shared calendar."]
EMBEDDED_TOKENS = 40  # the prompts (> 128 tokens) overflow each policy's budget before the first token
EMBEDDED = [{"kv": "window(sink=4,recent=64)"}, {"kv": "quant(bits=4)"}, {"kv": "snapkv(budget=128,window=32)"},
            {"weights": "torchao_int4", "kv": "window(sink=4,recent=64)"}]


@pytest.fixture(scope="module")
def embedded_plain(embedded):
    return {p: specdec.generate(embedded, None, p, max_new_tokens=EMBEDDED_TOKENS) for p in EMBEDDED_PROMPTS}


@pytest.mark.slow
@pytest.mark.parametrize("options", EMBEDDED, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_embedded_self_draft_reproduces_plain_greedy(embedded, embedded_plain, options):
    if "weights" in options and not specdec.quant.availability(options["weights"], "cpu").ok:
        pytest.skip(f"{options['weights']} cannot run here (the `torchao` extra)")
    drafter = build("self_draft", target=embedded, **options)
    for prompt, plain in embedded_plain.items():
        out = specdec.generate(embedded, drafter, prompt, shape="chain(4)", max_new_tokens=EMBEDDED_TOKENS)
        i = next((i for i, (x, y) in enumerate(zip(plain.token_ids, out.token_ids)) if x != y), None)
        if i is None:
            assert out.token_ids == plain.token_ids
            continue
        top2 = next_token_logits(embedded, plain.prompt_ids + plain.token_ids[:i]).topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, f"{options}: {prompt!r} differs at {i} without a near-tie"
    assert drafter.cache.evicted > 0 or "quant" in options["kv"], f"{options}: the policy evicted nothing"
    assert len(plain.prompt_ids) > 128

