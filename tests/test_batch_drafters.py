"""Model drafters in batches (`specdec.generate_batch`): self_draft with every KV policy, small,
lowbit and hierarchical draft each row what they draft for its prompt alone, and every row's output
equals its prompt alone, token for token (tiny fp64 targets; chain, static tree, dynamic; prompts of
mixed lengths, one of a single token; rows that stop early). At T > 0 row b equals its prompt alone
with seed + b. A drafter on the CUDA-graph cache is refused by name. The embedded target: four chat
prompts of different lengths through a lossy self-draft equal each prompt alone."""

import pytest
import torch

import specdec
from specdec.drafters import build
from specdec.drafters.registry import build_for_tests

SHAPES = ["chain(4)", "tree(2,2,1)", "dynamic(top_k=3,depth=4,budget=10)"]
LIMITS = [12, 5, 9, 12]
DRAFTERS = {
    "self_draft full": ("self_draft", {}),
    "self_draft window": ("self_draft", {"kv": "window(sink=2,recent=5)"}),
    "self_draft snapkv": ("self_draft", {"kv": "snapkv(budget=6,window=2)"}),
    "self_draft quant(4)": ("self_draft", {"kv": "quant(bits=4,group=4)"}),
    "self_draft window+quant(2), rtn8 weights": ("self_draft", {"kv": "window(sink=1,recent=4)+quant(bits=2)",
                                                                "weights": "rtn8_pc"}),
    "self_draft snapkv+window, first(1)": ("self_draft", {"kv": "snapkv(budget=8,window=3)+window(sink=1,recent=6)",
                                                          "layers": "first(1)"}),
    "small (early exit)": ("small", {"layers": 1}),
    "small (a draft model)": ("small", "model"),
    "lowbit": ("lowbit", None),
    "hierarchical (eagle)": ("hierarchical", None),
    "hierarchical (self_draft window)": ("hierarchical", {"top": "self_draft",
                                                          "top_options": {"kv": "window(sink=1,recent=3)"},
                                                          "mid_quant": "rtn8_pc"}),
}


@pytest.fixture(scope="module")
def prompts():
    """Four prompts of different lengths (one of a single token)."""
    base = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    return [base * 3, base[:3], (base * 2)[:11], [5]]


def make(case: str, target):
    name, options = DRAFTERS[case]
    if options is None:
        return build_for_tests(name, target=target)
    if options == "model":  # a second, smaller model of the same family and vocabulary
        family = target.model.config.model_type
        draft = specdec.tiny_target(family, vocab_size=64, dtype=torch.float64, seed=3, logit_scale=4.0)
        return build(name, target=target, model=draft)
    return build(name, target=target, **options)


class DraftLog:
    """Records every draft of a drafter per prompt, in a batch or alone (a batch row asked for no
    depth, whose prompt alone would not be asked at all, is not recorded)."""

    def __init__(self, drafter, rows: int) -> None:
        self.drafts: list[list] = [[] for _ in range(rows)]
        self.active = list(range(rows))  # the prompt of each batch row
        self.drafter = drafter
        self.methods = drafter.propose, drafter.propose_batch, drafter.select_rows
        propose, propose_batch, select_rows = self.methods

        def one(request):
            draft = propose(request)
            self.drafts[0].append(draft)
            return draft

        def batch(request):
            drafts = propose_batch(request)
            for b, (prompt, draft) in enumerate(zip(self.active, drafts)):
                if request.row(b).max_depth >= 1:
                    self.drafts[prompt].append(draft)
            return drafts

        def select(rows):
            select_rows(rows)
            self.active = [self.active[b] for b in rows]

        drafter.propose, drafter.propose_batch, drafter.select_rows = one, batch, select

    def close(self) -> None:
        """Stop recording: the drafter's own methods back."""
        self.drafter.propose, self.drafter.propose_batch, self.drafter.select_rows = self.methods


def assert_same_drafts(batch: list, alone: list, row: int) -> None:
    """The row's drafts in the batch equal its drafts alone, step for step (each row is asked for
    its own depth limit, `DraftRequest.max_depths`)."""
    assert len(batch) == len(alone), f"row {row}: {len(batch)} drafts in the batch, {len(alone)} alone"
    for step, (in_batch, by_itself) in enumerate(zip(batch, alone)):
        assert in_batch.tokens.tolist() == by_itself.tokens.tolist(), f"row {row} step {step}: drafts differ"
        assert in_batch.parents.tolist() == by_itself.parents.tolist(), f"row {row} step {step}: trees differ"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", list(DRAFTERS))
def test_greedy_rows_draft_and_output_what_they_do_alone(tiny64, prompts, case, shape):
    drafter = make(case, tiny64)
    assert drafter.batchable
    log = DraftLog(drafter, len(prompts))
    outs = specdec.generate_batch(tiny64, drafter, prompts, shape=shape, max_new_tokens=LIMITS, chat=False,
                                  stop_on_eos=False)
    log.close()
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
        alone_log = DraftLog(drafter, 1)
        alone = specdec.generate(tiny64, drafter, prompt, shape=shape, max_new_tokens=limit, chat=False,
                                 stop_on_eos=False)
        assert out.token_ids == alone.token_ids, f"row {b}"
        assert len(out.token_ids) == limit
        alone_log.close()
        assert_same_drafts(log.drafts[b], alone_log.drafts[0], b)
        assert [s.accepted for s in out.stats.steps] == [s.accepted for s in alone.stats.steps], f"row {b}"


@pytest.mark.parametrize("shape", ["tree(2,2,1)", "auto"])
@pytest.mark.parametrize("case", ["self_draft quant(4)", "small (a draft model)"])
def test_the_static_draft_cache_and_auto_batch(tiny_llama64, prompts, case, shape):
    """The drafters' preallocated cache (`cache='static'`) and `shape='auto'` give every row its output alone."""
    name, options = DRAFTERS[case]
    options = {"model": specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=3, logit_scale=4.0)} \
        if options == "model" else options
    drafter = build(name, target=tiny_llama64, cache="static", **options)
    outs = specdec.generate_batch(tiny_llama64, drafter, prompts, shape=shape, max_new_tokens=LIMITS, chat=False,
                                  stop_on_eos=False)
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
        alone = specdec.generate(tiny_llama64, drafter, prompt, shape=shape, max_new_tokens=limit, chat=False,
                                 stop_on_eos=False)
        assert out.token_ids == alone.token_ids, f"row {b}"


def first_draft_forwards(drafter, models: list, target, prompts: list, shape: str) -> int:
    """Forwards of `models` during the drafter's first proposal for `prompts` (one or a batch)."""
    calls = []
    for model in models:  # an instance attribute shadows the method for every caller
        model.forward = lambda *args, inner=model.forward, **kwargs: calls.append(1) or inner(*args, **kwargs)
    counted = []
    propose, propose_batch = drafter.propose, drafter.propose_batch

    def counting(inner):
        def run(request):
            start = len(calls)
            drafts = inner(request)
            counted.append(len(calls) - start)
            return drafts
        return run

    drafter.propose, drafter.propose_batch = counting(propose), counting(propose_batch)
    try:
        specdec.generate_batch(target, drafter, prompts, shape=shape, max_new_tokens=6, chat=False, stop_on_eos=False)
    finally:
        drafter.propose, drafter.propose_batch = propose, propose_batch
        for model in models:
            del model.forward
    return counted[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", ["self_draft snapkv", "small (a draft model)", "hierarchical (self_draft window)"])
def test_a_batch_costs_the_draft_forwards_of_one_row(tiny_llama64, prompts, case, shape):
    """Drafting four rows runs the draft models as often as drafting one (forwards batched, never a
    loop over rows), counted on the first step, where every row drafts to the same depth."""
    drafter = make(case, tiny_llama64)
    models = [drafter.top.model, drafter.mid] if case.startswith("hierarchical") else [drafter.model]
    one = first_draft_forwards(drafter, models, tiny_llama64, prompts[:1], shape)
    four = first_draft_forwards(drafter, models, tiny_llama64, prompts, shape)
    assert one >= 2 and four == one


@pytest.mark.parametrize("kv", ["window(sink=1,recent=3)", "snapkv(budget=4,window=1)+quant(bits=2)"])
def test_lossy_rows_accept_what_they_accept_alone(tiny_llama64, kv):
    """A lossy cache makes rows accept different counts per step; each row keeps its own count."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3, 1], [2, 6, 1, 9, 9, 4, 3], [7, 7, 0, 1, 5, 11, 12, 13]]
    drafter = build("self_draft", target=tiny_llama64, kv=kv, weights="rtn8_pc", layers="first(1)")
    outs = specdec.generate_batch(tiny_llama64, drafter, prompts, shape="chain(3)", max_new_tokens=16, chat=False,
                                  stop_on_eos=False)
    per_row = [[s.accepted for s in out.stats.steps] for out in outs]
    assert len({tuple(a) for a in per_row}) > 1, per_row
    for b, prompt in enumerate(prompts):
        alone = specdec.generate(tiny_llama64, drafter, prompt, shape="chain(3)", max_new_tokens=16, chat=False,
                                 stop_on_eos=False)
        assert outs[b].token_ids == alone.token_ids, f"row {b}"
        assert per_row[b] == [s.accepted for s in alone.stats.steps], f"row {b}"


SAMPLED = [("self_draft window+quant(2), rtn8 weights", shape) for shape in SHAPES] + [
    ("self_draft snapkv+window, first(1)", "chain(4)"), ("small (a draft model)", "chain(4)"),
    ("lowbit", "chain(4)"), ("hierarchical (self_draft window)", "tree(2,2,1)")]


@pytest.mark.parametrize("case, shape", SAMPLED)
def test_sampled_rows_equal_their_seed_alone(tiny_llama64, prompts, case, shape):
    """At T > 0 row b with seed s equals its prompt alone with seed s + b, token for token: a row's
    draft samples (chains) only from the row's own generator, to the row's own depth limit."""
    drafter = make(case, tiny_llama64)
    outs = specdec.generate_batch(tiny_llama64, drafter, prompts, shape=shape, max_new_tokens=LIMITS,
                                  temperature=1.0, seed=7, chat=False)
    for b, (prompt, out, limit) in enumerate(zip(prompts, outs, LIMITS)):
        alone = specdec.generate(tiny_llama64, drafter, prompt, shape=shape, max_new_tokens=limit,
                                 temperature=1.0, seed=7 + b, chat=False)
        assert out.token_ids == alone.token_ids, f"row {b}"


def test_a_drafter_on_the_graph_cache_is_refused_by_name(tiny_llama64, prompts):
    drafter = build("self_draft", target=tiny_llama64, cache="graphs")
    assert not drafter.batchable
    with pytest.raises(ValueError, match="'self_draft' cannot draft a batch"):
        specdec.generate_batch(tiny_llama64, drafter, prompts, max_new_tokens=4, chat=False)


def test_a_hierarchical_drafter_batches_when_its_top_does(tiny_llama64, prompts):
    drafter = build("hierarchical", target=tiny_llama64, top="self_draft", top_options={"cache": "graphs"},
                    mid_quant="rtn8_pc")
    assert not drafter.batchable
    with pytest.raises(ValueError, match="'hierarchical' cannot draft a batch"):
        specdec.generate_batch(tiny_llama64, drafter, prompts, max_new_tokens=4, chat=False)


def test_embedded_self_draft_batch_equals_each_prompt_alone(embedded):
    """Four chat prompts of different lengths, a lossy self-draft: each row equals its prompt alone."""
    prompts = ["Hi!", "Name three primary colors.", "Write one sentence about the sea and the wind at night.",
               "What is 2 + 2?"]
    drafter = build("self_draft", target=embedded, kv="window(sink=4,recent=12)+quant(bits=4)")
    outs = specdec.generate_batch(embedded, drafter, prompts, shape="chain(4)", max_new_tokens=24,
                                  stop_on_eos=False)
    assert len({len(embedded.encode_prompt(p)) for p in prompts}) == len(prompts)
    for b, (prompt, out) in enumerate(zip(prompts, outs)):
        alone = specdec.generate(embedded, drafter, prompt, shape="chain(4)", max_new_tokens=24, stop_on_eos=False)
        assert out.token_ids == alone.token_ids, f"row {b}: {out.text!r} != {alone.text!r}"
