"""Property-based fuzz of `generate_batch` (hypothesis): drawn drafters, shapes, batches, limits,
sampling settings and stop sets, on tiny fp64 targets, with drafters reused across examples.

Every example draws a target (llama or qwen2), a drafter from a pool built once per module (every
registered drafter, plus a lossy self-draft; one that is not `batchable` gets batch 1), a shape
(chain(k), tree(w...), dynamic(top_k, depth, budget) or auto), a batch of 1-4 token-id prompts of
mixed lengths (one-token prompts included), `max_new_tokens` (one number or one per row; a 0 is
drawn now and then, a documented input error) and top_k / top_p, and a stop set: the target's EOS,
none, or a token that occurs mid-way in one row's output without a stop set. The properties:

- nothing raises but the documented input error: ValueError naming `max_new_tokens`;
- at T = 0 every row equals plain decoding of its prompt alone (`generate(target, None, ...)`, the
  same limit and stop set), token for token;
- at T = 0.7 the same call twice gives the same tokens, and with a concrete shape row b equals its
  prompt alone with seed + b, token for token (`generate_batch`'s docstring). `auto` is held to
  neither at T > 0: the shapes it picks depend on measured timings and on what the drafter object
  learned in earlier generations (`specdec.core.auto_policy`), and so do the random numbers drawn;
  its rows are checked for length and stop only.

The budget: DEFAULT_EXAMPLES examples split over the properties (about 30 s of CPU on one core).
`SPECDEC_FUZZ=N` in the environment sets the total to N for a long run; hypothesis' statistics
(`--hypothesis-show-statistics`) give the exact count per property. Hypothesis keeps no database.
"""

import functools
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import specdec
from specdec.drafters import build, names
from specdec.drafters.registry import build_for_tests

DEFAULT_EXAMPLES = 600
PROPERTIES = 2
EXAMPLES = math.ceil((int(os.environ.get("SPECDEC_FUZZ", "0")) or DEFAULT_EXAMPLES) / PROPERTIES)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FAMILIES = ["llama", "qwen2"]
VARIANTS = {"self_draft[window+quant(2)]": ("self_draft", {"kv": "window(sink=1,recent=4)+quant(bits=2)"})}
DRAFTERS = sorted(names()) + sorted(VARIANTS)
VOCAB = 64


@functools.cache
def target(family: str):
    return specdec.tiny_target(family, vocab_size=VOCAB, dtype=torch.float64, seed=0, logit_scale=4.0)


@functools.cache
def drafter(family: str, key: str):
    """One drafter per (target, pool key), built once and reused by every example that draws it."""
    if key in VARIANTS:
        name, options = VARIANTS[key]
        return build(name, target=target(family), **options)
    return build_for_tests(key, target=target(family))


@functools.cache
def plain(family: str, prompt: tuple[int, ...], limit: int, eos: frozenset[int] | None) -> list[int]:
    """Plain greedy decoding of one prompt alone (the oracle), memoized across examples."""
    return specdec.generate(target(family), None, list(prompt), max_new_tokens=limit, chat=False,
                            eos=eos).token_ids


@st.composite
def shapes(draw) -> str:
    """chain(k), tree(w...), dynamic(top_k, depth, budget) or auto."""
    kind = draw(st.sampled_from(["chain", "tree", "dynamic", "auto"]))
    if kind == "chain":
        return f"chain({draw(st.integers(1, 5))})"
    if kind == "tree":
        return f"tree({','.join(map(str, draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))))})"
    if kind == "dynamic":
        top_k, depth, budget = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 12))
        return f"dynamic(top_k={top_k},depth={depth},budget={budget})"
    return "auto"


@st.composite
def cases(draw, temperature: float) -> dict:
    """One call's arguments but the stop set (drawn later, from the model's output)."""
    family, key = draw(st.sampled_from(FAMILIES)), draw(st.sampled_from(DRAFTERS))
    batchable = getattr(drafter(family, key), "batchable", False)
    prompts = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                            min_size=1, max_size=4 if batchable else 1))
    limits = draw(st.lists(st.integers(1, 9), min_size=len(prompts), max_size=len(prompts)))
    if draw(st.integers(0, 9)) == 9:  # a 0 now and then (~7%: hypothesis favours 0 itself), an input error
        limits[draw(st.integers(0, len(limits) - 1))] = 0
    one_limit = len(set(limits)) == 1 and draw(st.booleans())
    return dict(family=family, key=key, prompts=prompts, limits=limits,
                max_new_tokens=limits[0] if one_limit else limits, shape=draw(shapes()),
                temperature=temperature, top_k=draw(st.sampled_from([0, 1, 3, VOCAB])),
                top_p=draw(st.sampled_from([1.0, 0.9, 0.5])), seed=draw(st.integers(0, 2**16)))


def stop_set(data, case: dict, free: list[list[int]]) -> frozenset[int] | None:
    """The target's EOS (None), no stop (empty), or a token mid-way in a row's unstopped output
    `free[b]` (so that row, and any other row that emits it, stops early), maybe with one more."""
    kind = data.draw(st.sampled_from(["mid", "target", "none"]), label="eos kind")  # hypothesis favours the first
    event(f"eos {kind}")
    if kind == "target":
        return None
    if kind == "none":
        return frozenset()
    row = free[data.draw(st.integers(0, len(free) - 1), label="eos row")]
    picked = {row[data.draw(st.integers(len(row) // 3, max(len(row) // 3, len(row) - 2)), label="eos at")]}
    return frozenset(picked | data.draw(st.sets(st.integers(0, VOCAB - 1), max_size=1), label="eos extra"))


def run(case: dict, eos, **changes) -> specdec.BatchOutput:
    call = {**case, **changes}
    return specdec.generate_batch(target(call["family"]), drafter(call["family"], call["key"]), call["prompts"],
                                  shape=call["shape"], max_new_tokens=call["max_new_tokens"],
                                  temperature=call["temperature"], top_k=call["top_k"], top_p=call["top_p"],
                                  seed=call["seed"], chat=False, eos=eos)


def refused(case: dict) -> bool:
    """A call with a 0 limit raises the documented ValueError before any work; True if it was one.
    Also labels the example for hypothesis' statistics (drafter, shape kind, batch size)."""
    event(f"drafter {case['key']}")
    event(f"shape {case['shape'].split('(')[0]}")
    event(f"batch {len(case['prompts'])}")
    if min(case["limits"]) >= 1:
        return False
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 0"):
        run(case, None)
    return True


def assert_stops(out: specdec.BatchOutput, case: dict, eos) -> None:
    """Every row is at most its limit long and ends at its first stop token or at its limit."""
    stops = set(target(case["family"]).eos_token_ids) if eos is None else eos
    for b, (row, limit) in enumerate(zip(out, case["limits"])):
        ids = row.token_ids
        assert 1 <= len(ids) <= limit and row.stats.new_tokens == len(ids), (b, ids, limit)
        assert not stops.intersection(ids[:-1]) and (len(ids) == limit or ids[-1] in stops), (b, ids, eos)


@FUZZ
@given(cases(temperature=0.0), st.data())
def test_greedy_rows_equal_plain_decoding(case, data):
    if refused(case):
        return
    family, prompts = case["family"], case["prompts"]
    free = [plain(family, tuple(p), limit, frozenset()) for p, limit in zip(prompts, case["limits"])]
    eos = stop_set(data, case, free)
    out = run(case, eos)
    assert len(out) == len(prompts)
    for b, (prompt, limit) in enumerate(zip(prompts, case["limits"])):
        assert out[b].token_ids == plain(family, tuple(prompt), limit, eos), f"row {b}"
    assert_stops(out, case, eos)


@FUZZ
@given(cases(temperature=0.7), st.data())
def test_sampled_rows_reproduce_their_seed(case, data):
    if refused(case):
        return
    free = [row.token_ids for row in run(case, frozenset())]
    eos = stop_set(data, case, free)
    out = run(case, eos)
    assert_stops(out, case, eos)
    if case["shape"] == "auto":  # see the module docstring
        return
    tokens = [row.token_ids for row in out]
    assert [row.token_ids for row in run(case, eos)] == tokens, "the same call twice"
    for b, (prompt, limit) in enumerate(zip(case["prompts"], case["limits"])):
        alone = run(case, eos, prompts=[prompt], max_new_tokens=limit, seed=case["seed"] + b)
        assert alone[0].token_ids == tokens[b], f"row {b} differs from its prompt alone with seed + {b}"
