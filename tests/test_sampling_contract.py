"""The contract of `specdec.core.sampling`, checked against a plain per-row reference: the target law
softmax(logits / T) truncated by top-k and top-p, on any leading shape and dtype, and the settings'
validation with its exact messages. These tests kill the mutants of sampling.py that the exactness
tests let through (the mutmut audit of docs/measurements/mutation-testing.md)."""

import dataclasses
import math

import pytest
import torch

from specdec.core.sampling import SamplingConfig, target_probs_from_logits


def reference_law(row: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The target law of one row of logits, written out: greedy = one-hot of the first maximum;
    else softmax(z / T) over the top-k tokens (every token tied with the k-th kept), then the smallest
    prefix of the tokens sorted by probability whose mass reaches top_p, renormalised."""
    v = len(row)
    if temperature == 0.0:
        first = max(range(v), key=lambda i: (row[i], -i))
        return [float(i == first) for i in range(v)]
    z = [x / temperature for x in row]
    keep = set(range(v))
    if 0 < top_k < v:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = {i for i in keep if z[i] >= kth}
    m = max(z[i] for i in keep)
    weights = [math.exp(z[i] - m) if i in keep else 0.0 for i in range(v)]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        mass, kept = 0.0, set()
        for i in sorted(range(v), key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            kept.add(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = [probs[i] / total if i in kept else 0.0 for i in range(v)]
    return probs


CONFIGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 1, 1.0), (0.7, 3, 1.0),
           (1.0, 6, 1.0), (1.0, 7, 1.0), (1.0, 9, 1.0), (1.0, 0, 0.3), (0.8, 0, 0.9), (1.3, 4, 0.6)]


@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 7), (1, 1, 7)])
@pytest.mark.parametrize("temperature, top_k, top_p", CONFIGS)
def test_the_target_law_is_the_reference_law_of_every_row(shape, temperature, top_k, top_p):
    """Every row of a [V], [N, V] or [B, N, V] tensor (N != V, so a wrong dimension cannot pass)
    gets the law of the reference, for greedy, temperatures around 1, top-k up to past V and top-p."""
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float64) * 2
    sampling = SamplingConfig(temperature, top_k, top_p)
    probs = target_probs_from_logits(logits, sampling)
    assert probs.shape == logits.shape and probs.dtype == torch.float64
    for row, got in zip(logits.reshape(-1, shape[-1]).tolist(), probs.reshape(-1, shape[-1])):
        expected = torch.tensor(reference_law(row, temperature, top_k, top_p), dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_logits_give_a_float32_law(dtype):
    """The law is computed and returned in float32 at least, whatever the logits' dtype."""
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.5)):
        probs = target_probs_from_logits(logits, SamplingConfig(0.7, top_k, top_p))
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    expected = (logits.float() / 0.7).softmax(-1)
    torch.testing.assert_close(target_probs_from_logits(logits, SamplingConfig(0.7)), expected)


def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly():
    """Four equal tokens (1/4 each, exact in binary): top_p = 0.5 keeps exactly two of them at 1/2
    (the set reaches 0.5 after two; a third would only be kept by a strict comparison)."""
    probs = target_probs_from_logits(torch.zeros(4, dtype=torch.float64), SamplingConfig(1.0, top_p=0.5))
    assert sorted(probs.tolist()) == [0.0, 0.0, 0.5, 0.5]


def test_without_top_p_a_negligible_token_keeps_its_mass():
    """top_p = 1 leaves the law alone, also where the float32 mass before the last token rounds to 1."""
    logits = torch.tensor([0.0, -30.0])
    probs = target_probs_from_logits(logits, SamplingConfig(1.0))
    assert float(probs[1]) > 0.0
    assert torch.equal(probs, logits.softmax(-1))


def test_the_defaults_are_greedy_without_filters():
    sampling = SamplingConfig()
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed) == (0.0, 0, 1.0, 0)
    assert sampling.greedy and not SamplingConfig(1e-30).greedy


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingConfig().temperature = 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, r"^temperature must be >= 0 \(0 = greedy\), got -0.5$"),
    ({"top_k": -1}, r"^top_k must be an integer >= 0 \(0 = off\), got -1$"),
    ({"top_k": 2.0}, r"^top_k must be an integer >= 0 \(0 = off\), got 2.0$"),
    ({"top_p": 0.0}, r"^top_p must be in \(0, 1\] \(1 = off\), got 0.0$"),
    ({"top_p": 1.5}, r"^top_p must be in \(0, 1\] \(1 = off\), got 1.5$"),
])
def test_bad_settings_are_refused_with_their_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"temperature": 0.5}, {"top_k": 0}, {"top_k": 1},
                                    {"top_p": 1.0}, {"top_p": 1e-9}])
def test_edge_settings_are_accepted(kwargs):
    SamplingConfig(**kwargs)


# ---- the law against two written elsewhere: transformers' warpers, the certificate's reference ----

HF_CONFIGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.6, 0, 1.0), (1.0, 3, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.8),
              (0.7, 0, 0.8), (1.6, 0, 0.5), (0.7, 5, 0.9), (1.3, 12, 0.6)]
"""(temperature, top_k, top_p) at T > 0: each filter alone, with a temperature on either side of 1, and combined."""


def transformers_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax after transformers' Temperature-, TopK- and TopPLogitsWarper, in their generate order."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", HF_CONFIGS)
def test_the_target_law_is_transformers_warper_law(temperature, top_k, top_p):
    """Rows of 32 tokens without ties: temperature, then top-k, then top-p, as transformers applies them."""
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(top_k + 7), dtype=torch.float64) * 3
    got = target_probs_from_logits(logits, SamplingConfig(temperature, top_k, top_p))
    torch.testing.assert_close(got, transformers_law(logits, temperature, top_k, top_p), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("temperature, top_k, top_p", CONFIGS + HF_CONFIGS)
def test_the_certificate_law_is_the_reference_law(temperature, top_k, top_p):
    """The certificate's oracle (`specdec.certify.cases.reference_law`) is a third writing of the law."""
    from specdec.certify.cases import reference_law as certificate_law

    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    logits[1, 3:6] = logits[1, 0]  # a tie at the top
    logits[2, :] = logits[2, 0]  # every token tied
    sampling = SamplingConfig(temperature, top_k, top_p)
    for row in logits.tolist():
        expected = reference_law(row, temperature, top_k, top_p)
        for got in (certificate_law(row, sampling), target_probs_from_logits(torch.tensor(row, dtype=torch.float64), sampling).tolist()):
            assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("vocab, top_p, kept", [(4, 0.5, 2), (64, 0.25, 16), (1024, 0.125, 128), (4096, 0.5, 2048)])
def test_ties_in_top_p_keep_the_lowest_indices(vocab, top_p, kept):
    """Equal probabilities (exact in binary): the nucleus is the first `kept` tokens in index order (a stable sort), as the
    reference law says; an unstable sort keeps some other set of the same size."""
    probs = target_probs_from_logits(torch.zeros(vocab, dtype=torch.float64), SamplingConfig(1.0, top_p=top_p))
    expected = torch.tensor(reference_law([0.0] * vocab, 1.0, 0, top_p), dtype=torch.float64)
    assert torch.equal(probs, expected)
    assert torch.equal(probs.nonzero().flatten(), torch.arange(kept))


def test_a_nucleus_on_the_untempered_softmax_fails_the_reference():
    """The certificate's `nucleus_on_untempered` mutant (top-p chosen before the temperature) moves the
    law away from the reference at T != 1; the real function agrees with it."""
    from specdec.certify.mutants import mutant, mutated

    logits = torch.randn(8, 12, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2
    sampling = SamplingConfig(0.5, top_p=0.7)
    expected = torch.tensor([reference_law(row, 0.5, 0, 0.7) for row in logits.tolist()], dtype=torch.float64)
    torch.testing.assert_close(target_probs_from_logits(logits, sampling), expected, rtol=1e-12, atol=1e-15)
    with mutated(mutant("nucleus_on_untempered")):
        moved = target_probs_from_logits(logits, sampling)
    assert (moved - expected).abs().sum(-1).max() > 0.05
