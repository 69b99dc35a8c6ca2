"""End to end on the embedded SmolLM2-135M-Instruct: greedy speculation reproduces plain greedy
decoding in fp32 (under each linear kernel) and in bf16, with a garbage drafter and with the n-gram
drafter.

The near-tie rule: a tree forward of many tokens and a one-token forward round differently, so a
speculative run may leave the plain run where the target's top two logits are closer than the
rounding: the first position where the two outputs differ is *excused* when the plain model's top-2
logits there are within NEAR_TIE[dtype]; any other difference fails. fp32: 1e-3. bf16: derived, not
guessed: `python scripts/bench_width_effect.py` measures the largest shift of the plain top-1 minus
top-2 logit gap between the plain loop and drafted runs on this target in bf16 (record kind
`width_effect`, rendered in docs/measurements/<machine key>.md, field `near_tie_derivation`), and the
allowance is its `near_tie_allowance` (NEAR_TIE_MARGIN = 2 x that shift; `tests/test_width_effect.py`
checks that NEAR_TIE[bf16] is the largest recorded allowance). The number of excused positions is
printed and recorded as the test property `excused_positions`."""

import pytest
import torch

import specdec
from specdec.runtime import kernels
from specdec.machine import cache_root as cache_dir
from specdec.loading import embedded_model_dir
from specdec.loop.reference import next_token_logits

PROMPTS = [
    "Why is the sky blue?",
    "List the first ten prime numbers.",
    "Summarize: The cat sat on the mat. The cat was happy. The mat was red.",
    "Repeat after me: one two three, one two three, one two three.",
]
NEW_TOKENS = 20
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 1.375}  # bf16: the recorded near_tie_allowance (see above)
"""Largest top-1 minus top-2 logit gap at which a divergence from the plain loop is excused."""

pytestmark = pytest.mark.slow


def test_embedded_target_loads_from_the_safetensors_cache(embedded):
    assert embedded_model_dir().parent == cache_dir()
    assert (embedded_model_dir() / "model.safetensors").exists()
    assert embedded.vocab_size == 49152 and embedded.hidden_size == 576
    assert embedded.tokenizer.chat_template and embedded.eos_token_ids
    ids = embedded.encode_prompt("Hi")
    assert embedded.decode(ids[-3:]).strip() == "assistant"
    assert embedded.encode_prompt("Hi", chat=False) == embedded.tokenizer.encode("Hi")


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.fixture(scope="module", params=["fp32-torch", "fp32-onednn", "bf16-auto"])
def target(request, embedded):
    """The embedded target under each linear kernel in fp32 (the fixture `embedded` is `auto`'s
    choice), and in bf16."""
    dtype, kernel = request.param.split("-")
    reason = kernels.why_not(kernel, "cpu", torch.float32) if kernel != "auto" else None
    if reason:
        pytest.skip(f"kernel {kernel} cannot run here: {reason}")
    if dtype == "fp32" and embedded.kernel == kernel:
        return embedded
    return specdec.load_target("smollm2-135m", dtype=torch.float32 if dtype == "fp32" else torch.bfloat16,
                               kernel=kernel)


@pytest.fixture(scope="module")
def plain_outputs(embedded):
    return {p: specdec.generate(embedded, None, p, max_new_tokens=NEW_TOKENS) for p in PROMPTS}


@pytest.mark.parametrize("name, shape", [("random", "tree(2,2)"), ("ngram", "chain(4)")])
def test_greedy_speculation_reproduces_plain_greedy(target, name, shape, record_property):
    drafter = specdec.drafters.build(name, target=target)
    excused = []
    for prompt in PROMPTS:
        plain = specdec.generate(target, None, prompt, max_new_tokens=NEW_TOKENS)
        spec = specdec.generate(target, drafter, prompt, shape=shape, max_new_tokens=NEW_TOKENS)
        i = _first_difference(plain.token_ids, spec.token_ids)
        if i is None:
            assert plain.token_ids == spec.token_ids
            continue
        logits = next_token_logits(target, plain.prompt_ids + plain.token_ids[:i]).float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap <= NEAR_TIE[target.dtype], (
            f"{target.dtype} {name}: {prompt!r} differs at token {i}, top-2 gap {gap:.3g} is no near-tie")
        excused.append((prompt, i, gap))
    record_property("excused_positions", len(excused))
    print(f"{target.dtype} {name} {shape}: {len(excused)} excused position(s) of {len(PROMPTS)} prompts: {excused}")


def test_plain_loop_matches_hugging_face_generate(embedded, plain_outputs):
    for prompt in PROMPTS[:2]:
        ours = plain_outputs[prompt]
        ids = torch.tensor([ours.prompt_ids])
        hf = embedded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False)
        assert hf[0, ids.shape[1]:].tolist() == ours.token_ids
