"""End to end on the embedded SmolLM2-135M-Instruct (fp32): greedy speculation reproduces plain
greedy decoding on 10 prompts with a garbage drafter and with the n-gram drafter."""

import pytest
import torch

import specdec
from specdec.loading import cache_dir, embedded_model_dir
from specdec.reference import next_token_logits

PROMPTS = [
    "Why is the sky blue?",
    "List the first ten prime numbers.",
    "Write a Python function that reverses a string.",
    "Translate 'good morning, my friend' into French.",
    "What is 17 times 23? Show your work.",
    "Summarize: The cat sat on the mat. The cat was happy. The mat was red.",
    "Repeat after me: one two three, one two three, one two three.",
    "Give three tips for sleeping well.",
    "What is the capital of Japan, and what is it famous for?",
    "Explain what a hash table is in two sentences.",
]
NEW_TOKENS = 20

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


@pytest.fixture(scope="module")
def plain_outputs(embedded):
    return {p: specdec.generate(embedded, None, p, max_new_tokens=NEW_TOKENS) for p in PROMPTS}


@pytest.mark.parametrize("name, shape", [("random", "tree(2,2)"), ("ngram", "chain(4)")])
def test_greedy_speculation_reproduces_plain_greedy(embedded, plain_outputs, name, shape):
    drafter = specdec.drafters.build(name, target=embedded)
    for prompt in PROMPTS:
        plain = plain_outputs[prompt]
        spec = specdec.generate(embedded, drafter, prompt, shape=shape, max_new_tokens=NEW_TOKENS)
        i = _first_difference(plain.token_ids, spec.token_ids)
        if i is None:
            assert plain.token_ids == spec.token_ids
            continue
        # fp32: a difference is only allowed where the top two logits are a near-tie.
        logits = next_token_logits(embedded, plain.prompt_ids + plain.token_ids[:i])
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, f"{name}: {prompt!r} differs at {i} without a near-tie"


def test_plain_loop_matches_hugging_face_generate(embedded, plain_outputs):
    for prompt in PROMPTS[:2]:
        ours = plain_outputs[prompt]
        ids = torch.tensor([ours.prompt_ids])
        hf = embedded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False)
        assert hf[0, ids.shape[1]:].tolist() == ours.token_ids
