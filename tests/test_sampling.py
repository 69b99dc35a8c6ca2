"""The target distribution at tiny temperatures: defined for every T > 0, never NaN.

`target_probs_from_logits` shifts the logits by their maximum before dividing by T, so a float32
forward at T = 1e-40 (where logits / T overflowed to inf and the softmax gave NaN) samples the
argmax, uniformly among exact ties, and generation equals greedy decoding."""

import pytest
import torch

import specdec
from specdec.loop.reference import reference_generate
from specdec.core.sampling import SamplingConfig, target_probs_from_logits


@pytest.mark.parametrize("temperature", [1e-39, 1e-40, 1e-45, 5e-324])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tiny_temperature_is_the_argmax_law(temperature, dtype):
    logits = torch.tensor([[3.0, 1.0, 2.9], [2.0, 2.0, -1.0]], dtype=dtype)
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.5)):
        probs = target_probs_from_logits(logits, SamplingConfig(temperature, top_k, top_p))
        assert not probs.isnan().any()
        torch.testing.assert_close(probs[0], torch.tensor([1.0, 0.0, 0.0], dtype=probs.dtype))
    tied = target_probs_from_logits(logits, SamplingConfig(temperature))[1]
    torch.testing.assert_close(tied, torch.tensor([0.5, 0.5, 0.0], dtype=tied.dtype))


def test_the_shift_leaves_ordinary_temperatures_alone():
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 5
    for t in (0.3, 1.0, 2.5):
        torch.testing.assert_close(target_probs_from_logits(logits, SamplingConfig(t)), (logits / t).softmax(-1))


@pytest.mark.parametrize("name, shape", [("random", "chain(3)"), ("small", "tree(2,2)"), ("ngram", "chain(2)")])
def test_generation_at_a_tiny_temperature_is_greedy(name, shape):
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=0, logit_scale=4.0)
    prompt = [1, 5, 9, 5, 9, 5, 9, 13]
    greedy = reference_generate(target, prompt, max_new_tokens=12, stop_on_eos=False)
    drafter = specdec.drafters.build_for_tests(name, target=target)
    out = specdec.generate(target, drafter, prompt, shape=shape, max_new_tokens=12, temperature=1e-40, seed=3,
                           stop_on_eos=False)
    assert out.token_ids == greedy
    sampled = reference_generate(target, prompt, max_new_tokens=12, stop_on_eos=False,
                                 sampling=SamplingConfig(temperature=1e-40, seed=3))
    assert sampled == greedy


@pytest.mark.parametrize("bad", [-1e-40, float("nan")])
def test_a_negative_or_nan_temperature_is_an_error(bad):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(temperature=bad)
