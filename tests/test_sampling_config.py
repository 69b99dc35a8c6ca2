"""`SamplingConfig`'s contract: its defaults, its immutability and every value it refuses, with the
exact message. These kill the surviving mutants of `specdec/core/sampling.py` that scripts/
mutation_test.py lists (defaults changed, `or` -> `and` in the top-k check, `<` -> `<=` and 1 -> 2 in
the top-p bounds, edited messages, `frozen=False`)."""

import dataclasses

import pytest

from specdec.core.sampling import SamplingConfig


def test_the_defaults_are_greedy_unfiltered_and_seed_zero():
    config = SamplingConfig()
    assert (config.temperature, config.top_k, config.top_p, config.seed) == (0.0, 0, 1.0, 0)
    assert config.greedy and not SamplingConfig(temperature=1e-300).greedy


def test_a_config_is_immutable_and_hashable():
    config = SamplingConfig(temperature=0.7, top_k=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.temperature = 1.0
    assert hash(config) == hash(SamplingConfig(temperature=0.7, top_k=3))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature must be >= 0 (0 = greedy), got -1.0"),
    ({"top_k": -1}, "top_k must be an integer >= 0 (0 = off), got -1"),
    ({"top_k": 2.0}, "top_k must be an integer >= 0 (0 = off), got 2.0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1] (1 = off), got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1] (1 = off), got 1.5"),
    ({"top_p": -0.1}, "top_p must be in (0, 1] (1 = off), got -0.1"),
])
def test_a_bad_value_is_refused_with_a_message_naming_it(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingConfig(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"top_k": 0}, {"top_k": 1}, {"top_p": 1.0},
                                    {"top_p": 1e-9}])
def test_the_edges_of_every_range_are_accepted(kwargs):
    SamplingConfig(**kwargs)
