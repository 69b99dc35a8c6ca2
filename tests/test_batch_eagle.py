"""EAGLE in a batch (`specdec.generate_batch`): every row drafts what it drafts alone and outputs what it
outputs alone (chain, static tree, dynamic tree; mixed prompt lengths, rows stopping early, both
rollbacks; `auto`: outputs), rows sample only from their own generator, each draft depth is one head forward for the
whole batch, and a head that cannot run rows at their own positions is refused.

Tiny fp64 targets with an untrained head (token-exact); the embedded target with its shipped head.
"""

import pytest
import torch

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.core.grow import grow_tree
from specdec.core.shapes import parse_shape
from specdec.drafters import build
from specdec.drafters.eagle import random_head
from specdec.drafters.eagle_head import EagleHead, widen
from specdec.drafters.lockstep import grow_rows

SHAPES = ["chain(4)", "tree(2,2,1)", "dynamic(top_k=3,depth=4,budget=10)"]
LIMITS = [12, 5, 9, 12]


@pytest.fixture(scope="module")
def prompts():
    """Four prompts of different lengths (one of a single token: nothing to draft from at first)."""
    base = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    return [base * 3, base[:3], (base * 2)[:11], [5]]


class DraftLog:
    """Within `with`, records every draft of an EAGLE drafter per prompt, (the row's max_depth, draft),
    in a batch or alone."""

    def __init__(self, drafter, rows: int) -> None:
        self.drafter = drafter
        self.drafts: list[list] = [[] for _ in range(rows)]
        self.active = list(range(rows))  # the prompt of each batch row
        propose, propose_batch, select_rows = drafter.propose, drafter.propose_batch, drafter.select_rows

        def one(request):
            draft = propose(request)
            self.drafts[0].append((request.max_depth, draft))
            return draft

        def batch(request):
            drafts = propose_batch(request)
            for b, (prompt, draft) in enumerate(zip(self.active, drafts)):
                depth = request.row(b).max_depth
                if depth < 1:  # the row's last token: alone, the loop would not ask
                    assert draft.num_nodes == 0
                    continue
                self.drafts[prompt].append((depth, draft))
            return drafts

        def select(rows):
            select_rows(rows)
            self.active = [self.active[b] for b in rows]

        drafter.propose, drafter.propose_batch, drafter.select_rows = one, batch, select

    def __enter__(self) -> "DraftLog":
        return self

    def __exit__(self, *exc) -> None:
        del self.drafter.propose, self.drafter.propose_batch, self.drafter.select_rows


def shape_depth(shape: str) -> int:
    spec = parse_shape(shape)
    return getattr(spec, "k", None) or len(getattr(spec, "widths", ())) or spec.depth


def assert_same_drafts(batch: list, alone: list) -> None:
    """A row's drafts in the batch equal its drafts alone, step for step, and under the same depth limit."""
    assert len(batch) == len(alone)
    for step, ((depth_b, in_batch), (depth_a, by_itself)) in enumerate(zip(batch, alone)):
        assert depth_b == depth_a, f"step {step}"
        assert in_batch.tokens.tolist() == by_itself.tokens.tolist(), f"step {step}"
        assert in_batch.parents.tolist() == by_itself.parents.tolist(), f"step {step}"


@pytest.mark.parametrize("options", [{"refresh": True}, {"refresh": False}, {"draft_vocab": 24}])
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_rows_draft_and_output_what_they_do_alone(tiny64, prompts, shape, options):
    drafter = build("eagle", target=tiny64, head="random", **options)
    with DraftLog(drafter, len(prompts)) as log:
        outs = specdec.generate_batch(tiny64, drafter, prompts, shape=shape, max_new_tokens=LIMITS, chat=False)
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
        with DraftLog(drafter, 1) as alone_log:
            alone = specdec.generate(tiny64, drafter, prompt, shape=shape, max_new_tokens=limit, chat=False)
        assert out.token_ids == alone.token_ids, f"row {b}"
        assert_same_drafts(log.drafts[b], alone_log.drafts[0])


@pytest.fixture(scope="module")
def small_vocab():
    """A tiny fp64 target over 8 tokens: an untrained head's guesses are often accepted, so rows keep
    paths of different lengths and the head's per-row rollback (`keep_rows`) has work to do."""
    return specdec.tiny_target("llama", vocab_size=8, dtype=torch.float64, seed=1, logit_scale=2.0)


SMALL_PROMPTS, SMALL_LIMITS = [[1, 2, 3, 4, 5, 6, 7], [3], [2, 6, 1], [7, 7, 0, 1, 5]], [16, 7, 12, 16]


@pytest.mark.parametrize("refresh", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_that_accept_differently_roll_back_per_row(small_vocab, shape, refresh):
    prompts, limits = SMALL_PROMPTS, SMALL_LIMITS
    drafter = build("eagle", target=small_vocab, head="random", refresh=refresh)
    with DraftLog(drafter, len(prompts)) as log:
        outs = specdec.generate_batch(small_vocab, drafter, prompts, shape=shape, max_new_tokens=limits, chat=False,
                                      stop_on_eos=False)
    accepted = [sum(s.accepted for s in out.stats.steps) for out in outs]
    assert len({a for a in accepted}) > 1 and max(accepted) > 0, accepted
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, limits)):
        with DraftLog(drafter, 1) as alone_log:
            alone = specdec.generate(small_vocab, drafter, prompt, shape=shape, max_new_tokens=limit, chat=False,
                                     stop_on_eos=False)
        assert out.token_ids == alone.token_ids, f"row {b}"
        assert_same_drafts(log.drafts[b], alone_log.drafts[0])


@pytest.mark.parametrize("refresh", [True, False])
def test_auto_rows_output_what_they_do_alone(small_vocab, refresh):
    """`auto` picks one shape per step for the batch (so rows draft other shapes than alone); every
    row's greedy output still equals its prompt alone."""
    prompts, limits = SMALL_PROMPTS, SMALL_LIMITS
    drafter = build("eagle", target=small_vocab, head="random", refresh=refresh)
    outs = specdec.generate_batch(small_vocab, drafter, prompts, shape="auto", max_new_tokens=limits, chat=False)
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, limits)):
        alone = specdec.generate(small_vocab, drafter, prompt, shape="auto", max_new_tokens=limit, chat=False)
        assert out.token_ids == alone.token_ids, f"row {b}"


@pytest.mark.parametrize("shape", SHAPES)
def test_a_head_fusing_aux_layers_batches(prompts, shape):
    """An EAGLE-3 style head (aux layers fused, fc_aux nonzero) drafts and outputs per row what it does alone."""
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=0, logit_scale=4.0)
    head = widen(random_head(target), (1,))
    with torch.no_grad():
        head.fc_aux.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    drafter = build("eagle", target=target, head=head, refresh=False)
    with DraftLog(drafter, len(prompts)) as log:
        outs = specdec.generate_batch(target, drafter, prompts, shape=shape, max_new_tokens=LIMITS, chat=False)
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
        with DraftLog(drafter, 1) as alone_log:
            alone = specdec.generate(target, drafter, prompt, shape=shape, max_new_tokens=limit, chat=False)
        assert out.token_ids == alone.token_ids, f"row {b}"
        assert_same_drafts(log.drafts[b], alone_log.drafts[0])


def toy_logits(row: int, tokens: torch.Tensor) -> torch.Tensor:
    """[1, n, 10] logits that depend on the row and the scored tokens only."""
    return torch.sin(tokens[..., None].double() * torch.arange(10) + row) * 3


@pytest.mark.parametrize("shape", SHAPES)
def test_grow_rows_grows_each_rows_draft_as_grow_tree_alone(shape):
    """Rows of different depth limits (0 = no draft: it never asks) sampled from their own generators:
    each row's draft equals `grow_tree` alone, and the rows' calls are answered in rounds, one per depth."""
    sampling, depths = SamplingConfig(temperature=1.0), [3, 1, 0, 4]
    roots = [toy_logits(b, torch.tensor([[b]]))[:, 0] for b in range(4)]
    rounds = []

    def score_rows(asks):
        rounds.append(sorted(asks))
        return {b: toy_logits(b, tokens) for b, (_, tokens, _) in asks.items()}

    drafts = grow_rows(parse_shape(shape), roots, score_rows, sampling,
                       [torch.Generator().manual_seed(b) for b in range(4)], depths)
    for b, (root, depth) in enumerate(zip(roots, depths)):
        alone = grow_tree(parse_shape(shape), root, lambda _, tokens, __, b=b: toy_logits(b, tokens), sampling,
                          torch.Generator().manual_seed(b), depth)
        assert drafts[b].tokens.tolist() == alone.tokens.tolist()
        assert drafts[b].parents.tolist() == alone.parents.tolist()
    deepest = min(4, shape_depth(shape))
    assert len(rounds) == deepest - 1 and rounds[0] == [0, 3]  # rows 1 and 2 never ask
    assert rounds[-1] == ([3] if deepest == 4 else [0, 3])  # row 0 stops at its depth 3


def test_grow_rows_raises_a_scoring_error_instead_of_hanging():
    def broken(asks):
        raise RuntimeError(f"no forward for rows {sorted(asks)}")

    roots = [toy_logits(b, torch.tensor([[b]]))[:, 0] for b in range(3)]
    with pytest.raises(RuntimeError, match=r"no forward for rows \[0, 1, 2\]"):
        grow_rows(parse_shape("chain(3)"), roots, broken, SamplingConfig(), [torch.Generator()] * 3, [4, 4, 4])


@pytest.mark.parametrize("shape", SHAPES)
def test_sampled_rows_equal_their_seed_alone(tiny_llama64, prompts, shape):
    """At T > 0 row b with seed s equals its prompt alone with seed s + b, token for token: the head
    samples (chains) only from the row's own generator."""
    drafter = build("eagle", target=tiny_llama64, head="random")
    outs = specdec.generate_batch(tiny_llama64, drafter, prompts, shape=shape, max_new_tokens=LIMITS,
                                  temperature=1.0, seed=7, chat=False)
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
        alone = specdec.generate(tiny_llama64, drafter, prompt, shape=shape, max_new_tokens=limit,
                                 temperature=1.0, seed=7 + b, chat=False)
        assert out.token_ids == alone.token_ids, f"row {b}"


@pytest.mark.parametrize("shape,depths", [("chain(4)", 4), ("tree(2,2,1)", 3), (SHAPES[2], 4)])
def test_each_depth_is_one_head_forward_for_the_whole_batch(tiny_llama64, prompts, shape, depths):
    """A drafting step runs the head once for every row's new pairs, then once per expanded depth for
    all rows (the last depth is scored by nobody): `depths` forwards a step at any batch size."""
    drafter = build("eagle", target=tiny_llama64, head="random")
    calls = []
    forward = drafter.head.forward
    drafter.head.forward = lambda *args, **kw: calls.append(args[0].shape[0]) or forward(*args, **kw)
    steps = specdec.generate_batch(tiny_llama64, drafter, prompts[:3], shape=shape, max_new_tokens=30, chat=False,
                                   stop_on_eos=False).stats.steps
    assert steps > 3 and len(calls) <= steps * depths
    assert calls[:depths] == [3] * depths  # the first step: one forward per depth, all three rows in it


def test_a_head_that_cannot_run_rows_at_their_own_positions_is_refused(tiny_llama64, prompts):
    class SharedPositions(EagleHead):
        takes_row_positions = False

    head = random_head(tiny_llama64)
    shared = SharedPositions(head.config, draft_vocab=head.draft_vocab)
    drafter = build("eagle", target=tiny_llama64, head=shared)
    assert not drafter.batchable
    with pytest.raises(ValueError, match="drafter 'eagle' cannot draft a batch"):
        specdec.generate_batch(tiny_llama64, drafter, prompts, max_new_tokens=4, chat=False)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["chain(4)", "dynamic(top_k=6,depth=5,budget=24)"])
def test_embedded_batch_equals_each_prompt_alone(embedded, shape):
    """Four chat prompts of different lengths, the shipped head: every row equals `generate` on its
    prompt alone, and the head still pays in a batch."""
    texts = ["Hi.", "Name three primary colors.", "Write one sentence about the sea and the moon together.",
             "List the days of the week, then the months of the year, in order, separated by commas."]
    rows = [embedded.encode_prompt(t) for t in texts]
    assert len({len(r) for r in rows}) == 4
    drafter = build("eagle", target=embedded)
    outs = specdec.generate_batch(embedded, drafter, rows, shape=shape, max_new_tokens=24, stop_on_eos=False,
                                  chat=False)
    for b, (row, out) in enumerate(zip(rows, outs)):
        alone = specdec.generate(embedded, drafter, row, shape=shape, max_new_tokens=24, stop_on_eos=False, chat=False)
        assert out.token_ids == alone.token_ids, f"row {b}"
    mal = outs.stats.row_mal  # 24 tokens a row: one row's MAL is noisy, the batch's mean is the claim
    assert sum(mal) / len(mal) > 1.5 and min(mal) > 1.2, mal
