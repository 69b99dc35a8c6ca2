"""EAGLE training: batched rollouts equal one-at-a-time ones, the training-time-test unroll equals chain
drafting, the multi-depth loss decreases, every prompt source is disjoint from every evaluation suite,
and bad inputs give clear errors. Tiny fp32 models only. (Rollout sets on disk: tests/test_eagle_tokens.py; the run: tests/test_eagle_run.py.)
"""

import json
from pathlib import Path

import pytest
import torch

import specdec
from specdec.drafters import build
from specdec.drafters.eagle import random_head
from specdec.drafters.eagle_head import EagleHead, HeadConfig
from specdec.training.eagle import Rollouts, acceptance_per_depth, depth_losses, make_batch, rollout_batch, unroll
from specdec.training.prompts import SOURCES, check_disjoint, collect, prompt_text, shared_ngrams, user

from specdec.runtime.cache import KVCache
from specdec.drafters import DraftRequest
from specdec.loop.decode import prefill
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import parse_shape

SUITES = sorted((Path(__file__).resolve().parents[1] / "experiments" / "prompts").glob("*.jsonl"))
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [2, 9, 4, 4], [7], [1, 1, 2, 3, 5, 8], [13, 2], [6, 6, 6]]


@pytest.fixture(scope="module")
def tiny():
    return specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=0, logit_scale=4.0)


def test_batched_rollouts_equal_one_prompt_at_a_time(tiny):
    batched = rollout_batch(tiny, PROMPTS[:4], max_new_tokens=8, temperature=0.0)
    for i, prompt in enumerate(PROMPTS[:4]):
        single = rollout_batch(tiny, [prompt], max_new_tokens=8, temperature=0.0)
        assert batched.sequences[i].tolist() == single.sequences[0].tolist()
        torch.testing.assert_close(batched.hidden[i], single.hidden[0], atol=1e-4, rtol=1e-4)
        assert batched.prompt_len[i] == len(prompt)


def test_rows_that_end_early_leave_the_batch_without_changing_any_row(tiny, monkeypatch):
    """With an EOS that some rows hit mid-way, batched rollouts (finished rows dropped from the cache)
    still equal one-prompt-at-a-time rollouts, and each sequence stops right before its EOS."""
    free = rollout_batch(tiny, PROMPTS, max_new_tokens=10, temperature=0.0)
    gens = [s[n:].tolist() for s, n in zip(free.sequences, free.prompt_len)]
    counts = {}
    for g in gens:
        for t in set(g[1:6]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (0 < counts[t] < len(gens), counts[t]))  # some rows end early, not all
    monkeypatch.setattr(type(tiny), "eos_token_ids", property(lambda self: {eos}))
    batched = rollout_batch(tiny, PROMPTS, max_new_tokens=10, temperature=0.0)
    ended = 0
    for i, prompt in enumerate(PROMPTS):
        single = rollout_batch(tiny, [prompt], max_new_tokens=10, temperature=0.0)
        assert batched.sequences[i].tolist() == single.sequences[0].tolist()
        torch.testing.assert_close(batched.hidden[i], single.hidden[0], atol=1e-4, rtol=1e-4)
        gen = batched.sequences[i][len(prompt):].tolist()
        assert eos not in gen
        if eos in gens[i]:
            assert gen == gens[i][:gens[i].index(eos)]
            ended += 1
        assert batched.hidden[i].shape[0] == batched.sequences[i].numel()
    assert 0 < ended < len(PROMPTS)


def test_unroll_predicts_what_chain_drafting_drafts(tiny):
    """Depth s of the training-time test at the root's pair equals the s-th node of a chain draft."""
    head = random_head(tiny).float()
    prompt, depth = [5, 6, 7, 8, 9, 10, 3], 4
    # In the target's dtype, as the unroll computes: head_dtype="auto" would time float32 against
    # bfloat16 on this machine and could draft in bfloat16.
    drafter = build("eagle", target=tiny, head=head, draft_vocab=None, head_dtype=None)
    drafter.reset()
    drafter.commit(prefill(tiny, KVCache(), prompt))
    request = DraftRequest(token_ids=torch.tensor([prompt]), shape=parse_shape(f"chain({depth})"),
                           sampling=SamplingConfig(), generator=torch.Generator().manual_seed(0), max_depth=16)
    draft = drafter.propose(request).tokens[0].tolist()
    seq = prompt + draft  # the draft taken as accepted: the tokens the unroll reads
    rollout = rollout_batch(tiny, [prompt], max_new_tokens=1, temperature=0.0)  # true features of the prompt
    data = Rollouts([torch.tensor(seq)], [torch.cat([rollout.hidden[0], torch.zeros(depth, tiny.hidden_size)])],
                    [0], [len(prompt)], [0.0])
    outs = unroll(head, tiny.base.get_input_embeddings(), make_batch(data, [0], 64), depth)
    j = len(prompt) - 2  # the pair (h_{m-1}, t_m) of root t_m
    drafted = [int(tiny.lm_head(o[0, j]).argmax()) for o in outs]
    assert drafted == draft


def test_multi_depth_loss_decreases_and_validation_reports_every_depth(tiny):
    torch.manual_seed(0)
    data = rollout_batch(tiny, PROMPTS, max_new_tokens=12, temperature=0.0)
    data.prompt_index = list(range(len(PROMPTS)))
    embed = tiny.base.get_input_embeddings()
    rows = tiny.lm_head.weight.detach()
    batch = make_batch(data, list(range(len(PROMPTS))), 64)
    def full_loss(head):
        return depth_losses(unroll(head, embed, batch, 3), batch, rows, ce_weight=0.5)[0].item()

    head = random_head(tiny).float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    before = full_loss(head)
    for _ in range(30):
        loss, stats = depth_losses(unroll(head, embed, batch, 3), batch, rows, ce_weight=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = full_loss(head)
    assert after < 0.85 * before, f"loss {before:.3f} -> {after:.3f}"
    assert set(stats) == {"top1@1", "top1@2", "top1@3"}
    stats = acceptance_per_depth(head.eval(), embed, rows, torch.arange(64), [batch], 3)
    assert stats["positions"] > 0 and 1.0 <= stats["chain_mal"] <= 4.0
    assert all(0.0 <= stats[f"acc@{s}"] <= 1.0 for s in (1, 2, 3))


def _suite_turns() -> list[str]:
    assert SUITES, "no evaluation suites found: the disjointness check must not be skipped"
    return [t for f in SUITES for line in f.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_every_prompt_source_is_disjoint_from_every_evaluation_suite(source):
    """No prompt shares an 8-word run with any turn of experiments/prompts/*.jsonl (chat_heldout
    included) or contains a whole shorter turn; 3,000 prompts per source (the counts trained on)."""
    prompts = SOURCES[source](3000, 0)
    assert prompts, f"source {source!r} is empty"
    overlap = shared_ngrams(prompts, _suite_turns())
    assert not overlap, f"{source}: {len(overlap)} prompts overlap an evaluation suite, e.g. {overlap[:2]}"


def test_natural_sources_are_written_chats_and_a_bad_line_is_named(tmp_path):
    """Every natural_*.jsonl is a registered source of distinct chats (user first and last, some
    multi-turn); a line with an even number of turns is an error naming the file and line."""
    from specdec.training import prompts as sources

    names = [n for n in SOURCES if n.startswith("natural-")]
    assert len(names) == len(list(sources.PROMPTS_DIR.glob("natural_*.jsonl"))) >= 2
    for name in names:
        prompts = SOURCES[name](100_000, 0)
        assert len(prompts) >= 500 and len({prompt_text(p) for p in prompts}) == len(prompts)
        assert all(p[0]["role"] == p[-1]["role"] == "user" for p in prompts) and any(len(p) == 3 for p in prompts)
        assert SOURCES[name](50, 1) != SOURCES[name](50, 0) and SOURCES[name](50, 0) == prompts[:50]
    bad = tmp_path / "natural_bad.jsonl"
    bad.write_text('{"turns": ["hi"]}\n{"turns": ["hi", "hello"]}\n')
    with pytest.raises(ValueError, match="natural_bad.jsonl:2: 'turns' must be an odd number"):
        sources.load([bad])


def test_without_the_repository_s_prompt_folder_the_natural_sources_say_what_is_missing(tmp_path, monkeypatch):
    """The prompts are data of the source checkout (data/prompts/), not of the package: an install
    without that folder gets an error naming it and how to get it, not an empty source."""
    from specdec.training import prompts as sources

    monkeypatch.setattr(sources, "PROMPTS_DIR", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="absent, which does not exist.*pip install -e"):
        SOURCES["natural-life"](5, 0)
    with pytest.raises(ValueError, match=r"absent is absent: no natural-\* sources"):
        collect({"natural-nowhere": 5})


def test_an_overlapping_validation_set_is_an_error():
    val = [user("please explain how the tides of the ocean follow the moon every single day")]
    train = [user("write a short poem about a cat sleeping in the warm afternoon sun")]
    check_disjoint(train, val)  # no shared 8-word run: accepted
    leaked = train + [user(prompt_text(val[0]) + " Please.")]
    with pytest.raises(ValueError, match="share a 8-word run with the validation split"):
        check_disjoint(leaked, val)


def test_bad_inputs_give_clear_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="no training prompts"):
        collect({"natural-life": 0})
    with pytest.raises(ValueError, match="unknown prompt source"):
        collect({"wikipedia": 10})
    SOURCES["empty-for-test"] = lambda n, seed: []
    try:
        with pytest.raises(ValueError, match="empty-for-test.*gave no prompts"):
            collect({"empty-for-test": 5, "natural-life": 5})
    finally:
        del SOURCES["empty-for-test"]
    other = specdec.tiny_target("llama", vocab_size=80, dtype=torch.float32)
    path = random_head(other).save(tmp_path / "other-head")
    with pytest.raises(ValueError, match="other-head.safetensors holds a head for another target or head config"):
        EagleHead.load(path).config.check_same_geometry(HeadConfig.for_target(tiny), path)


def test_unroll_with_aux_layers_predicts_what_a_fused_head_drafts(tiny, monkeypatch):
    """As test_unroll_predicts_what_chain_drafting_drafts, for a head fusing layer 1: depth 1 reads the
    aux features, deeper depths none, exactly as drafting does."""
    from specdec.drafters.eagle_head import widen

    monkeypatch.setattr(tiny, "aux_layers", ())
    head = widen(random_head(tiny).float(), (1,))
    with torch.no_grad():
        head.fc_aux.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    prompt, depth = [5, 6, 7, 8, 9, 10, 3], 4
    # In the target's dtype, as the unroll computes: head_dtype="auto" would time float32 against
    # bfloat16 on this machine and could draft in bfloat16.
    drafter = build("eagle", target=tiny, head=head, draft_vocab=None, head_dtype=None)
    drafter.reset()
    step = prefill(tiny, KVCache(), prompt)
    drafter.commit(step)
    request = DraftRequest(token_ids=torch.tensor([prompt]), shape=parse_shape(f"chain({depth})"),
                           sampling=SamplingConfig(), generator=torch.Generator().manual_seed(0), max_depth=16)
    draft = drafter.propose(request).tokens[0].tolist()
    seq = prompt + draft
    pad = torch.zeros(depth + 1, tiny.hidden_size)
    data = Rollouts([torch.tensor(seq)], [torch.cat([step.target_hidden[0], pad])], [0], [len(prompt)], [0.0],
                    [torch.cat([step.target_aux[0], pad])])
    outs = unroll(head, tiny.base.get_input_embeddings(), make_batch(data, [0], 64), depth)
    j = len(prompt) - 2
    assert [int(tiny.lm_head(o[0, j]).argmax()) for o in outs] == draft
