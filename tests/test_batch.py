"""Batches through the one loop (`specdec.generate_batch`): every row equals its prompt run alone,
the cache's per-row rollback equals a fresh prefill, rows draw only their own randomness, and bad
batches are refused before any work."""

import pytest
import torch

import specdec
from specdec.core.curve import LatencyCurve
from specdec.loop import rows
from specdec.core.draft import Draft
from specdec.drafters.common import PerRow
from specdec.drafters.registry import build_for_tests, names
from specdec.runtime.cache import KVCache
from specdec.runtime.static_cache import StaticKVCache

SHAPES = ["chain(4)", "tree(2,2,1)", "dynamic(top_k=3,depth=4,budget=10)", "auto"]
LIMITS = [12, 5, 9, 12]


@pytest.fixture(scope="module")
def prompts():
    """Four prompts of different lengths (one of a single token), one repetitive enough for lookups."""
    base = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    return [base * 3, base[:3], (base * 2)[:11], [5]]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", [None, "ngram", "random"])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_rows_equal_their_prompt_alone(tiny64, prompts, name, shape, cache):
    drafter = None if name is None else build_for_tests(name, target=tiny64)
    outs = specdec.generate_batch(tiny64, drafter, prompts, shape=shape, max_new_tokens=LIMITS, cache=cache,
                                  chat=False)
    assert len(outs) == len(prompts) and outs.stats.rows == len(prompts)
    for prompt, out, limit in zip(prompts, outs, LIMITS):
        alone = specdec.generate(tiny64, drafter, prompt, shape=shape, max_new_tokens=limit, cache=cache, chat=False)
        assert out.token_ids == alone.token_ids
    assert outs.stats.new_tokens == sum(len(o.token_ids) for o in outs)


@pytest.mark.parametrize("shape", ["chain(4)", "dynamic(top_k=3,depth=4,budget=10)"])
def test_batch_steps_record_the_padded_width_and_the_rows_left(tiny64, prompts, shape):
    """Step j of the batch serves every row with more than j steps (all rows start together), and its
    forward is as wide as the widest of their verifications: the cost model's batch step."""
    outs = specdec.generate_batch(tiny64, build_for_tests("ngram", target=tiny64), prompts, shape=shape,
                                  max_new_tokens=LIMITS, chat=False)
    per_row = [o.stats.steps for o in outs]
    widths, shapes = {}, {}
    for j in range(max(map(len, per_row))):
        here = [steps[j] for steps in per_row if len(steps) > j]
        width = 1 + max(s.drafted for s in here)
        widths[width] = widths.get(width, 0) + 1
        shapes[len(here), width] = shapes.get((len(here), width), 0) + 1
    assert outs.stats.verify_widths == widths and outs.stats.verify_shapes == shapes
    # Each shape's forward seconds: the rows' steps of that shape share one forward, timed once.
    timed = outs.stats.verify_shape_time_s
    assert timed.keys() == shapes.keys() and min(timed.values()) > 0
    assert sum(timed.values()) == pytest.approx(outs.stats.target_time_s)
    assert sum(timed.values()) < sum(s.target_time_s for steps in per_row for s in steps)  # rows share forwards
    assert outs.stats.steps == max(map(len, per_row)) < sum(map(len, per_row))
    assert len({r for r, _ in shapes}) > 1  # rows left the batch
    assert len(widths) > 1  # and drafts of different sizes were padded


def test_sampled_rows_draw_only_their_own_randomness(tiny_llama64, prompts):
    """Row b with seed s equals the prompt alone with seed s + b, token for token (ngram drafts are
    deterministic, so only the rows' random streams matter)."""
    drafter = build_for_tests("ngram", target=tiny_llama64)
    outs = specdec.generate_batch(tiny_llama64, drafter, prompts, shape="tree(2,2,1)", max_new_tokens=LIMITS,
                                  temperature=1.0, seed=7, chat=False)
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
        alone = specdec.generate(tiny_llama64, drafter, prompt, shape="tree(2,2,1)", max_new_tokens=limit,
                                 temperature=1.0, seed=7 + b, chat=False)
        assert out.token_ids == alone.token_ids


@pytest.mark.parametrize("name", names())
@pytest.mark.parametrize("shape", [s for s in SHAPES if s != "auto"])
def test_sampled_rows_equal_their_seed_alone_for_every_drafter(tiny_llama64, prompts, name, shape):
    """`generate_batch`'s promise for a concrete shape: at T = 0.7 row b with seed s equals its prompt
    alone with seed s + b, token for token, for every registered drafter: each row drafts from its
    own generator only (a drafter that drew a row's draft from row 0's generator, or from a stream
    of its own seeded per row, fails here). `auto` promises it at T = 0 only (one shape per step for
    the whole batch): `test_greedy_rows_equal_their_prompt_alone`."""
    drafter = build_for_tests(name, target=tiny_llama64)
    for seed in (0, 7, 21):
        outs = specdec.generate_batch(tiny_llama64, drafter, prompts, shape=shape, max_new_tokens=LIMITS,
                                      temperature=0.7, seed=seed, chat=False)
        for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
            alone = specdec.generate(tiny_llama64, drafter, prompt, shape=shape, max_new_tokens=limit,
                                     temperature=0.7, seed=seed + b, chat=False)
            assert out.token_ids == alone.token_ids, f"row {b}, seed {seed}"


def test_a_row_that_stops_on_eos_leaves_the_batch(tiny_llama64, prompts):
    """With EOS set to a token row 0 emits early, row 0 stops there and the other rows still equal
    their prompts alone (their cache rows survive `select_rows`)."""
    free = specdec.generate(tiny_llama64, None, prompts[0], max_new_tokens=12, chat=False).token_ids
    eos = free[2]
    tiny_llama64.model.generation_config.eos_token_id = eos
    try:
        outs = specdec.generate_batch(tiny_llama64, None, prompts, max_new_tokens=12, chat=False)
        assert outs[0].token_ids[-1] == eos and len(outs[0].token_ids) <= 3
        for prompt, out in zip(prompts, outs):
            alone = specdec.generate(tiny_llama64, None, prompt, max_new_tokens=12, chat=False)
            assert out.token_ids == alone.token_ids
    finally:
        tiny_llama64.model.generation_config.eos_token_id = None


@pytest.mark.parametrize("make", [KVCache, lambda: StaticKVCache(64)])
def test_keep_rows_equals_a_fresh_prefill(tiny_llama64, make):
    """After a padded prefill of mixed lengths, a tree block and a per-row keep, each row's next
    logits equal a fresh prefill of exactly that row's kept tokens."""
    t = tiny_llama64
    rows = [[3, 9, 4, 1, 7, 7, 2], [5, 6, 1], [8, 2, 2, 9, 4, 1, 3, 3, 6, 0, 11]]
    width = max(map(len, rows))
    tokens = torch.zeros(3, width, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r)
    cache = make()
    t.forward(tokens, cache, valid=torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None])
    assert cache.next_positions.tolist() == [len(r) for r in rows]
    block = torch.tensor([[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]])
    t.forward(block, cache, torch.tensor([-1, 0, 0, 1]))
    kept = [[0, 1, 3], [0, 2], [0]]
    cache.keep_rows(width, kept)
    assert cache.next_positions.tolist() == [len(r) + len(k) for r, k in zip(rows, kept)]
    after = torch.tensor([[30, 31], [32, 33], [34, 35]])
    logits = t.forward(after, cache).logits
    for b, (r, k) in enumerate(zip(rows, kept)):
        fresh = make()
        ref = t.forward(torch.tensor([r + [int(block[b, i]) for i in k] + after[b].tolist()]), fresh).logits[0, -2:]
        torch.testing.assert_close(logits[b], ref)
    cache.select_rows([0, 2])
    assert cache.next_positions.tolist() == [len(rows[0]) + 5, len(rows[2]) + 3]


class LastChild(PerRow):
    """A test drafter that knows the target's greedy continuation and hides it as the *last* child
    at each depth (a wrong sibling first), so every accepted path is a non-prefix of the block."""

    name = "last-child"

    def __init__(self, target, depth: int = 3) -> None:
        self.target, self.depth = target, depth

    def reset(self) -> None:
        pass

    def propose(self, request):
        ids = request.token_ids[0].tolist()
        tokens, parents = [], []
        for _ in range(min(self.depth, request.max_depth)):
            nxt = int(self.target.forward(torch.tensor([ids]), KVCache()).logits[0, -1].argmax())
            parent = len(tokens) - 1 if tokens else -1
            tokens += [(nxt + 1) % self.target.vocab_size, nxt]
            parents += [parent, parent]
            ids.append(nxt)
        return Draft(torch.tensor([tokens]), torch.tensor(parents, dtype=torch.long))

    def commit_one(self, step) -> None:
        pass


@pytest.mark.parametrize("make", ["dynamic", "static"])
def test_a_wrong_keep_rule_is_caught(tiny_llama64, prompts, make, monkeypatch):
    """Rows whose accepted paths are never a prefix of their blocks equal their prompts alone, and
    stop doing so when `keep_rows` keeps the wrong entries (a mutant keeping each row's first ones)."""
    drafter = LastChild(tiny_llama64)
    run = lambda: [o.token_ids for o in specdec.generate_batch(  # noqa: E731
        tiny_llama64, drafter, prompts, shape="chain(6)", max_new_tokens=16, chat=False, cache=make)]
    alone = [specdec.generate(tiny_llama64, None, p, max_new_tokens=16, chat=False).token_ids for p in prompts]
    assert run() == alone
    for cls in (KVCache, StaticKVCache):
        real = cls.keep_rows
        monkeypatch.setattr(cls, "keep_rows", lambda self, begin, offsets, real=real: real(
            self, begin, [list(range(len(o))) for o in offsets]))
    assert run() != alone


def test_bad_batches_are_refused_before_any_work(tiny_llama64, prompts, monkeypatch):
    t = tiny_llama64
    with pytest.raises(ValueError, match="no prompts"):
        specdec.generate_batch(t, None, [])
    with pytest.raises(ValueError, match="max_new_tokens has 2 values for 4 prompts"):
        specdec.generate_batch(t, None, prompts, max_new_tokens=[3, 4], chat=False)
    with pytest.raises(ValueError, match=r"prompt 1 \(3 tokens\) \+ max_new_tokens"):
        specdec.generate_batch(t, None, prompts, max_new_tokens=[1, t.context_length, 1, 1], chat=False)
    with pytest.raises(ValueError, match="cache='graphs' runs one prompt"):
        specdec.generate_batch(t, None, prompts, cache="graphs", chat=False)

    class Single:
        name = "single"

    with pytest.raises(ValueError, match="drafter 'single' cannot draft a batch"):
        specdec.generate_batch(t, Single(), prompts, chat=False)
    monkeypatch.setattr(rows, "free_memory", lambda device: 1000)
    need = rows.kv_bytes(t, 4, 1)
    with pytest.raises(ValueError, match=r"a batch of 4 rows x \d+ cache slots needs .* GiB .* is free"):
        specdec.generate_batch(t, None, prompts, chat=False)
    assert need > 0


def test_auto_plans_a_batch_with_the_curve_of_its_batch_size(tiny_llama64, prompts):
    """A curve measured at batch 3 is stored under its own key and is the one `auto` at batch 3 reads;
    batch 1 keeps its own (here: none stored, so the untuned default of batch 1)."""
    from specdec.loop.auto_policy import AutoPolicy
    from specdec.core.shapes import parse_shape
    from specdec.loop.tuned import tuned_latency
    from specdec.measure.latency import cached_latency

    curve = cached_latency(tiny_llama64, widths=(1, 2, 4), contexts=(8,), repeats=1, cache="dynamic", batch=3)
    assert curve.batch == 3 and len(curve.seconds[0]) == 3
    assert tuned_latency(tiny_llama64, "dynamic", batch=3) == curve
    assert tuned_latency(tiny_llama64, "dynamic", batch=1).machine == "not tuned"
    assert tuned_latency(tiny_llama64, "dynamic", batch=2).seconds[0][1] == pytest.approx(1 + 3 / 24)
    policy = AutoPolicy(parse_shape("auto"), tiny_llama64, "dynamic", batch=3)
    assert policy.curve == curve


def hf_greedy(target, ids: list[int], new_tokens: int) -> list[int]:
    """Hugging Face `generate`, greedy, exactly `new_tokens` tokens (EOS does not stop it)."""
    x = torch.tensor([ids])
    out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None)
    return out[0, x.shape[1]:].tolist()


def test_embedded_batch_equals_hf_generate_per_prompt(embedded):
    """Four chat prompts of different lengths through one batch (plain and ngram) give, row for row,
    Hugging Face `generate`'s greedy tokens for that prompt alone."""
    texts = ["Hi.", "Name three primary colors.", "Write one sentence about the sea and the moon together.",
             "List the days of the week, then the months of the year, in order, separated by commas."]
    rows = [embedded.encode_prompt(t) for t in texts]
    assert len({len(r) for r in rows}) == 4
    expected = [hf_greedy(embedded, r, 20) for r in rows]
    for name in (None, "ngram"):
        drafter = None if name is None else specdec.drafters.build(name, target=embedded)
        outs = specdec.generate_batch(embedded, drafter, rows, max_new_tokens=20, stop_on_eos=False, chat=False,
                                      cache="static")
        assert [o.token_ids for o in outs] == expected


class Recorder(PerRow):
    """A test drafter that drafts nothing and records every row's commit (positions, kept count)."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []

    def reset(self) -> None:
        pass

    def propose(self, request):
        return Draft.empty()

    def propose_batch(self, request):
        return [Draft.empty() for _ in range(request.batch)]

    def commit(self, step) -> None:
        for b in range(step.batch):
            row = step.row(b)
            self.seen.append((b, row.positions[0].tolist()))

    def commit_one(self, step) -> None:
        pass


def test_steps_name_each_rows_absolute_positions(tiny_llama64, prompts):
    """The steps a batch drafter hears place each row's kept rows at that row's own positions: after
    the prefill 0 .. L_b - 2, then one position per step after (plain steps keep the root only)."""
    recorder = Recorder()
    specdec.generate_batch(tiny_llama64, recorder, prompts, max_new_tokens=3, chat=False, stop_on_eos=False)
    first = {b: pos for b, pos in recorder.seen[: len(prompts)]}
    assert first == {b: list(range(len(p) - 1)) for b, p in enumerate(prompts)}
    second = {b: pos for b, pos in recorder.seen[len(prompts): 2 * len(prompts)]}
    assert second == {b: [len(p) - 1] for b, p in enumerate(prompts)}


def test_batched_certificate_case_passes_and_names_unbatchable_drafters():
    """`batch.batch_case`: ngram's rows each follow their prompt's exact law; a drafter that
    cannot batch gets no case (None) rather than a PASS."""
    from specdec import certify
    from specdec.certify.batch import batch_case

    world = certify.tiny_world()
    case = batch_case(world.target, build_for_tests("ngram", target=world.target), "tree(2,2)", "top-k", 150)
    assert case.problem is None and case.p_value >= 1e-3 and case.steps > 0

    class Single:
        name = "single"

    assert batch_case(world.target, Single(), "chain(2)", "plain", 10) is None


def test_a_batch_and_its_latency_curve_run_the_same_cache(tiny64, prompts, monkeypatch):
    """`cache="auto"` is the preallocated cache for a batch, in `generate_batch` and in a latency curve
    at that batch (what the cost model prices a batch's steps with), and the growing one for one row."""
    from specdec.measure import latency
    from specdec.runtime.forwards import resolve_cache

    assert [resolve_cache("auto", tiny64, rows) for rows in (1, 2)] == ["dynamic", "static"]
    made, static = [], latency.CACHES["static"]

    def counted(target, capacity, buckets, owner=None):
        made.append(capacity)
        return static(target, capacity, buckets)

    monkeypatch.setitem(latency.CACHES, "static", counted)  # the one registry the loop reads too
    specdec.generate_batch(tiny64, None, prompts[:2], max_new_tokens=2, chat=False)
    curve = latency.measure_latency(tiny64, (1, 2), (4,), repeats=1, cache="auto", batch=2)
    assert len(made) == 2 and curve.batch == 2
    assert latency.curve_key(tiny64, (1, 2), (4,), 1, resolve_cache("auto", tiny64, 2), 2).startswith("static_")
    # With holes, every timed forward takes the explicit mask a batch of unequal rows verifies under.
    calls = []

    def forward(*args, **kwargs):
        calls.append(kwargs.get("valid") is not None)
        return plain_forward(*args, **kwargs)

    plain_forward = tiny64.forward
    monkeypatch.setattr(tiny64, "forward", forward)
    for holes in (False, True):
        calls.clear()
        timed = latency.measure_latency(tiny64, (1, 2), (4,), repeats=1, cache="static", batch=2, holes=holes)
        assert calls[1:] == [holes] * 4 and timed.holes is holes  # after the prefill: 2 widths, warm-up + 1
        assert LatencyCurve.from_json(timed.to_json()).holes is holes
