"""Bad input gets a clear error naming the value and what is accepted; nothing is clamped."""

import re

import pytest
import torch

import specdec
from specdec.drafters import Draft, build


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"shape": "tree(2,0)"}, "width >= 1"),
    ({"shape": "pyramid(3)"}, "cannot parse draft shape"),
])
def test_bad_generation_arguments(tiny_llama64, kwargs, match):
    with pytest.raises(ValueError, match=match):
        specdec.generate(tiny_llama64, None, [1, 2, 3], **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_where_there_is_none_fails_before_loading(device, monkeypatch):
    def no_load(**kwargs):
        raise AssertionError("loaded a model before checking the device")
    monkeypatch.setitem(specdec.loading._BUILTINS, "tiny-llama", no_load)
    with pytest.raises(ValueError, match=re.escape(f"device {device!r} requested but CUDA is not available here")):
        specdec.load_target("tiny-llama", device=device)


@pytest.mark.parametrize("kwargs, match", [({"device": "gpu"}, "device 'gpu' is not a torch device"),
                                           ({"dtype": "float33"}, "unknown dtype 'float33'")])
def test_bad_device_or_dtype_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        specdec.load_target("tiny-llama", **kwargs)


def test_empty_prompt(tiny_llama64):
    with pytest.raises(ValueError, match="prompt is empty"):
        specdec.generate(tiny_llama64, None, [])
    with pytest.raises(ValueError, match="prompt is empty"):
        specdec.generate(specdec.tiny_target("llama"), None, "")


def test_prompt_plus_max_new_tokens_longer_than_the_context(tiny_llama64):
    with pytest.raises(ValueError, match=r"exceeds the context length .*\(512\)"):
        specdec.generate(tiny_llama64, None, [1] * 500, max_new_tokens=13)


def test_token_ids_outside_the_vocabulary(tiny_llama64):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 64\)"):
        specdec.generate(tiny_llama64, None, [1, 64])


def test_string_prompt_without_a_tokenizer(tiny_llama64):
    with pytest.raises(ValueError, match="has no tokenizer"):
        specdec.generate(tiny_llama64, None, "hello")


def test_draft_whose_parents_are_not_a_tree():
    with pytest.raises(ValueError, match=r"parents is not a tree: parents\[1\] = 3"):
        Draft(torch.tensor([[1, 2, 3]]), torch.tensor([-1, 3, 0]))
    with pytest.raises(ValueError, match="Draft.tokens must be"):
        Draft(torch.tensor([[1, 2]]), torch.tensor([-1, 0, 1]))


def test_unknown_drafter_lists_the_registered_ones(tiny_llama64):
    with pytest.raises(KeyError, match="unknown drafter 'nope'; registered drafters: .*ngram"):
        build("nope", target=tiny_llama64)


def test_unknown_target_says_what_was_tried(tmp_path):
    with pytest.raises(OSError, match=r"could not load target 'no-such/model-xyz'.*built-in name.*smollm2-135m.*"
                                      r"hub id.*huggingface-cli download"):
        specdec.load_target("no-such/model-xyz")
    with pytest.raises(OSError, match="a local directory"):
        specdec.load_target(str(tmp_path))


def test_small_drafter_with_another_vocabulary(tiny_llama64):
    other = specdec.tiny_target("llama", vocab_size=32)
    with pytest.raises(ValueError, match="vocabulary 32.*64"):
        build("small", target=tiny_llama64, model=other)
