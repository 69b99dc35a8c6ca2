"""EAGLE training pipeline: shards (round trip, corruption named, resume without duplicates or gaps),
batched rollouts equal one-at-a-time ones, the training-time-test unroll equals chain drafting, the
multi-depth loss decreases, every prompt source is disjoint from every evaluation suite, and bad
inputs give clear errors. Tiny fp32 models only.
"""

import json
from pathlib import Path

import pytest
import torch

import specdec
from specdec.drafters import build
from specdec.drafters.eagle import random_head
from specdec.drafters.eagle_head import EagleHead, HeadConfig
from specdec.training.shards import Rollouts, ShardError, ShardStore, read_union
from specdec.training.eagle import (acceptance_per_depth, depth_losses, fill_shards, make_batch,
                                             rollout_batch, unroll)
from specdec.training.prompts import SOURCES, check_disjoint, collect, prompt_text, shared_ngrams, split, user

from specdec.runtime.cache import KVCache
from specdec.drafters import DraftRequest
from specdec.loop.decode import prefill
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import parse_shape

SUITES = sorted((Path(__file__).resolve().parents[1] / "experiments" / "prompts").glob("*.jsonl"))
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [2, 9, 4, 4], [7], [1, 1, 2, 3, 5, 8], [13, 2], [6, 6, 6]]
FINGERPRINT = {"target": "tiny-llama", "max_new_tokens": 6}


@pytest.fixture(scope="module")
def tiny():
    return specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=0, logit_scale=4.0)


def fill(tiny, store, **kw):
    fill_shards(tiny, store, PROMPTS, shard_prompts=3, batch_size=2, max_new_tokens=6, sampled_fraction=0.5,
                hidden_dtype=torch.float32, **kw)


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


def test_shards_round_trip_and_name_a_corrupt_truncated_or_missing_file(tiny, tmp_path):
    store = ShardStore(tmp_path, FINGERPRINT)
    fill(tiny, store)
    again = ShardStore(tmp_path, FINGERPRINT).read_all()
    direct = rollout_batch(tiny, PROMPTS[:3], max_new_tokens=6, temperature=0.0)
    assert [s.tolist() for s in again.sequences[:3]] == [s.tolist() for s in direct.sequences]
    assert again.prompt_index == list(range(len(PROMPTS)))
    assert again.temperature[3:6] == pytest.approx([0.7] * 3) and again.temperature[:3] == [0.0] * 3  # shard 1 sampled
    path = tmp_path / "shard-00001.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[:-7])
    with pytest.raises(ShardError, match="shard-00001.safetensors is truncated"):
        ShardStore(tmp_path, FINGERPRINT).read_all()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(ShardError, match="shard-00001.safetensors is corrupt"):
        ShardStore(tmp_path, FINGERPRINT).read_all()
    path.unlink()
    with pytest.raises(ShardError, match="shard-00001.safetensors is recorded .* but missing"):
        ShardStore(tmp_path, FINGERPRINT).read_all()
    with pytest.raises(ShardError, match="manifest.json was written for another configuration"):
        ShardStore(tmp_path, {**FINGERPRINT, "target": "smollm2-135m"})
    with pytest.raises(ShardError, match="already recorded"):
        store.write(0, direct, ["x"])
    with pytest.raises(ShardError, match="holds no recorded shards"):
        ShardStore(tmp_path / "empty", FINGERPRINT).read_all()


def test_a_resumed_run_never_duplicates_or_loses_a_shard(tiny, tmp_path):
    whole = ShardStore(tmp_path / "whole", FINGERPRINT)
    fill(tiny, whole)
    parts = ShardStore(tmp_path / "parts", FINGERPRINT)
    fill(tiny, parts, max_shards=1)  # the first run stops after one shard
    assert parts.done() == {0}
    (tmp_path / "parts" / "shard-00002.safetensors").write_bytes(b"half-written by a crashed run")  # unrecorded
    fill(tiny, ShardStore(tmp_path / "parts", FINGERPRINT))  # resumes: shards 1 and 2 only
    a, b = whole.read_all(), ShardStore(tmp_path / "parts", FINGERPRINT).read_all()
    assert b.prompt_index == list(range(len(PROMPTS))), "a prompt was lost or duplicated"
    assert [s.tolist() for s in a.sequences] == [s.tolist() for s in b.sequences]
    with pytest.raises(ShardError, match="generated from other prompts"):
        fill_shards(tiny, ShardStore(tmp_path / "parts", FINGERPRINT), PROMPTS[::-1], shard_prompts=3,
                    batch_size=2, max_new_tokens=6)


def test_workers_split_the_shards_and_their_union_is_the_whole(tiny, tmp_path):
    """Two workers write shards i % 2 == k into their own stores; a later single run skips what they
    hold; the union has every prompt exactly once, equal to one run's data."""
    whole = ShardStore(tmp_path / "whole", FINGERPRINT)
    fill(tiny, whole)
    w0, w1 = ShardStore(tmp_path / "w0", FINGERPRINT), ShardStore(tmp_path / "w1", FINGERPRINT)
    fill(tiny, w0, worker=(0, 2))
    fill(tiny, w1, worker=(1, 2), max_shards=0)  # worker 1 stopped before writing anything
    assert w0.done() == {0, 2} and w1.done() == set()
    late = ShardStore(tmp_path / "late", FINGERPRINT)
    fill(tiny, late, skip=w0.done())  # a single run afterwards writes only the missing shard
    assert late.done() == {1}
    union = read_union([w0, w1, late, ShardStore(tmp_path / "whole", FINGERPRINT)])  # 'whole' repeats all: read once
    order = sorted(range(len(union.prompt_index)), key=union.prompt_index.__getitem__)
    assert sorted(union.prompt_index) == list(range(len(PROMPTS))), "a prompt was lost or duplicated"
    assert [union.sequences[i].tolist() for i in order] == [s.tolist() for s in whole.read_all().sequences]
    with pytest.raises(ValueError, match="worker must be"):
        fill(tiny, w1, worker=(2, 2))
    other = ShardStore(tmp_path / "other", FINGERPRINT)
    fill_shards(tiny, other, PROMPTS[::-1], shard_prompts=3, batch_size=2, max_new_tokens=6, max_shards=1)
    with pytest.raises(ShardError, match="both shard 0 but continue other prompts"):
        read_union([w0, other])
    with pytest.raises(ShardError, match="no recorded shards"):
        read_union([w1])


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
    def full_loss(head):  # untruncated: comparable across steps (a truncated loss grows as more depths count)
        return depth_losses(unroll(head, embed, batch, 3), batch, rows, ce_weight=0.5)[0].item()

    for truncate in (False, True):
        head = random_head(tiny).float().train()
        opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
        before = full_loss(head)
        for _ in range(30):
            loss, stats = depth_losses(unroll(head, embed, batch, 3), batch, rows, ce_weight=0.5, truncate=truncate)
            opt.zero_grad()
            loss.backward()
            opt.step()
        after = full_loss(head)
        assert after < 0.85 * before, f"truncate={truncate}: loss {before:.3f} -> {after:.3f}"
        assert set(stats) == {"top1@1", "top1@2", "top1@3"}
    full, _ = depth_losses(unroll(head, embed, batch, 3), batch, rows, ce_weight=0.5)
    truncated, stats = depth_losses(unroll(head, embed, batch, 3), batch, rows, ce_weight=0.5, truncate=True)
    assert truncated.item() <= full.item() + 1e-6, "truncation may only drop positions"
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


def test_chat_prompts_vary_in_task_length_and_turns():
    prompts = SOURCES["chat"](2000, 0)
    turns = {len(p) for p in prompts}
    lengths = [len(prompt_text(p).split()) for p in prompts]
    assert 3 in turns and 1 in turns
    assert min(lengths) <= 6 and max(lengths) >= 40
    text = " ".join(prompt_text(p) for p in prompts)
    for marker in ("function", "Translate", "Rewrite", "JSON", "step by step", "?"):
        assert marker in text


def test_natural_sources_are_written_chats_and_a_bad_line_is_named(tmp_path):
    """Every natural_*.jsonl is a registered source of distinct chats (user first and last, some
    multi-turn); a line with an even number of turns is an error naming the file and line."""
    from specdec.training.prompts import natural

    names = [n for n in SOURCES if n.startswith("natural-")]
    assert len(names) == len(list(natural.HERE.glob("natural_*.jsonl"))) >= 2
    for name in names:
        prompts = SOURCES[name](100_000, 0)
        assert len(prompts) >= 500 and len({prompt_text(p) for p in prompts}) == len(prompts)
        assert all(p[0]["role"] == p[-1]["role"] == "user" for p in prompts) and any(len(p) == 3 for p in prompts)
        assert SOURCES[name](50, 1) != SOURCES[name](50, 0) and SOURCES[name](50, 0) == prompts[:50]
    bad = tmp_path / "natural_bad.jsonl"
    bad.write_text('{"turns": ["hi"]}\n{"turns": ["hi", "hello"]}\n')
    with pytest.raises(ValueError, match="natural_bad.jsonl:2: 'turns' must be an odd number"):
        natural.load([bad])


def test_split_is_disjoint_and_an_overlapping_validation_set_is_an_error():
    prompts = collect({"chat": 300, "stdlib": 40}, seed=1)
    train, val = split(prompts, 30, seed=1)
    assert len(val) == 30 and not shared_ngrams(train, [prompt_text(p) for p in val])
    leaked = train[:5] + [user(prompt_text(val[0]) + " Please.")]
    with pytest.raises(ValueError, match="share a 8-word run with the validation split"):
        check_disjoint(leaked, val)


def test_bad_inputs_give_clear_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="no training prompts"):
        collect({"chat": 0})
    with pytest.raises(ValueError, match="unknown prompt source"):
        collect({"wikipedia": 10})
    SOURCES["empty-for-test"] = lambda n, seed: []
    try:
        with pytest.raises(ValueError, match="empty-for-test.*gave no prompts"):
            collect({"empty-for-test": 5, "chat": 5})
    finally:
        del SOURCES["empty-for-test"]
    other = specdec.tiny_target("llama", vocab_size=80, dtype=torch.float32)
    path = random_head(other).save(tmp_path / "other-head")
    with pytest.raises(ValueError, match="other-head.safetensors holds a head for another target or head config"):
        EagleHead.load(path).config.check_same_geometry(HeadConfig.for_target(tiny), path)


def test_train_script_runs_end_to_end_and_resumes(tmp_path):
    """scripts/train_eagle.py on a tiny target: data + 3 steps, then resume=true to 5 steps (the
    shards are reused, not regenerated)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    common = ["target=tiny-llama", "sources=[templates-v1:24,stdlib:8]", "num_validation=4", "shard_prompts=8",
              "gen_batch_size=8", "max_new_tokens=8", "val_every=2", "ttt_depth=2", "truncate=true", "val_depth=2",
              "draft_vocab_size=200", "ce_vocab=200", "eval_vocab=100", "batch_size=4", f"out_dir={tmp_path}",
              f"hydra.run.dir={tmp_path}/hydra"]

    def run(*extra):
        return subprocess.run([sys.executable, "scripts/train_eagle.py", *common, *extra], cwd=root, text=True,
                              capture_output=True, env={**__import__("os").environ, "PYTHONPATH": str(root)})

    first = run("max_steps=3")
    assert first.returncode == 0, first.stderr[-2000:]
    manifest = (tmp_path / "data" / "train" / "manifest.json").read_text()
    second = run("max_steps=5", "resume=true")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stdout and "at step 3" in second.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5
    assert (tmp_path / "data" / "train" / "manifest.json").read_text() == manifest
    fused = run("max_steps=2", "aux_layers=[1]", f"init_head={tmp_path}/head-best.safetensors",
                f"data_dir={tmp_path}/data", f"out_dir={tmp_path}/fused")  # EAGLE-3 fusion from the plain head
    assert fused.returncode == 0, fused.stderr[-2000:]
    assert (tmp_path / "data" / "train" / "aux-1" / "manifest.json").exists()
    assert (tmp_path / "data" / "train" / "manifest.json").read_text() == manifest
    assert EagleHead.load(tmp_path / "fused" / "last.safetensors").config.aux_layers == (1,)
    assert json.loads((tmp_path / "fused" / "summary.json").read_text())["aux_backfilled_shards"] > 0  # old shards
    # another prompt list in its own data_dir, trained on together with the first run's data
    old = json.loads((tmp_path / "summary.json").read_text())["train_sequences"]
    mixed = run("max_steps=1", "sources=[stdlib:12]", f"data_dir={tmp_path}/data2", f"out_dir={tmp_path}/mixed",
                f"extra_data_dirs=[{tmp_path}/data]", "aux_layers=[1]",  # new shards: aux from the rollouts
                "seed=1", "sampled_fraction=1.0")  # other rollout settings than the extra dir's: read as recorded
    assert mixed.returncode == 0, mixed.stderr[-2000:]
    assert json.loads((tmp_path / "mixed" / "summary.json").read_text())["aux_backfilled_shards"] == 0
    store = tmp_path / "data2" / "train"
    assert (store / "aux-1" / "manifest.json").exists()
    new = len(read_union([ShardStore(store, json.loads((store / "manifest.json").read_text())["fingerprint"])]).sequences)
    assert json.loads((tmp_path / "mixed" / "summary.json").read_text())["train_sequences"] == old + new
    foreign = tmp_path / "foreign" / "train"
    foreign.mkdir(parents=True)
    recorded = json.loads((tmp_path / "data" / "train" / "manifest.json").read_text())
    recorded["fingerprint"]["target"] = "smollm2-135m"
    (foreign / "manifest.json").write_text(json.dumps(recorded))
    other = run("stage=train", "max_steps=1", f"out_dir={tmp_path}/other", f"extra_data_dirs=[{tmp_path}/foreign]")
    assert other.returncode != 0 and f"{foreign}/manifest.json holds rollouts of another target" in other.stderr
    lost = run("stage=train", "max_steps=1", f"out_dir={tmp_path}/lost", f"extra_data_dirs=[{tmp_path}/nowhere]")
    assert lost.returncode != 0 and "nowhere" in lost.stderr and "hold no training store" in lost.stderr
    # first_shard: a rerun of a prompt list whose first shards were trained on and lost writes only the rest
    later = run("stage=data", "first_shard=2", f"data_dir={tmp_path}/data3", f"out_dir={tmp_path}/later")
    assert later.returncode == 0, later.stderr[-2000:]
    store = tmp_path / "data3" / "train"
    assert ShardStore(store, json.loads((store / "manifest.json").read_text())["fingerprint"]).done() == {2, 3}  # of 0..3


def _train_script():
    """scripts/train_eagle.py as a module."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("train_eagle", Path(__file__).resolve().parents[1] / "scripts" / "train_eagle.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules["train_eagle"] = script  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(script)
    finally:
        del sys.modules["train_eagle"]
    return script


def test_train_script_refuses_a_checkpoint_of_another_geometry_by_name(tiny, tmp_path):
    script = _train_script()
    other = specdec.tiny_target("llama", vocab_size=80, dtype=torch.float32)
    path = random_head(other).save(tmp_path / "other")
    vocab = torch.arange(10)
    with pytest.raises(ValueError, match="other.safetensors holds a head for another target"):
        script.load_head(script.TrainConfig(init_head=str(path)), tiny, vocab, tmp_path)
    random_head(other).save(tmp_path / "last")
    torch.save({}, tmp_path / "last.state.pt")
    with pytest.raises(ValueError, match="last.safetensors holds a head for another target"):
        script.load_head(script.TrainConfig(resume=True), tiny, vocab, tmp_path)
    with pytest.raises(ValueError, match="must read 'name:count'"):
        script.parse_sources(["chat"])


def test_training_data_that_continues_a_validation_prompt_is_refused():
    """An extra data directory from another prompt list may hold validation prompts: caught by their tokens."""
    script = _train_script()

    def rollouts(*seqs):  # (tokens, prompt length) per sequence
        return Rollouts([torch.tensor(t) for t, _ in seqs], [torch.zeros(len(t), 2) for t, _ in seqs],
                        prompt_len=[n for _, n in seqs])

    val = rollouts(([1, 2, 3, 4], 2), ([7, 8, 9], 1))
    script.check_unseen(val, rollouts(([1, 2, 5], 3), ([7, 1], 2)), ["val", "train"])  # other prompts: fine
    with pytest.raises(ValueError, match=r"1 training sequences continue validation prompts \(validation val, "
                                         r"training a, b\)"):
        script.check_unseen(val, rollouts(([1, 2, 9, 9], 2), ([7, 1], 2)), ["val", "a", "b"])


def test_aux_features_are_the_targets_hidden_states_and_a_bad_file_is_named(tiny, tmp_path, monkeypatch):
    """fill_aux records, per shard, the target's hidden states of the aux layers for every token (equal to
    what the drafting loop hands a fused head), resumes without recomputing, and names a missing,
    corrupt or stale aux file."""
    from specdec.training.shards import AuxStore
    from specdec.training.eagle import fill_aux

    monkeypatch.setattr(tiny, "aux_layers", ())  # restored after the test: the module's target stays plain
    store = ShardStore(tmp_path / "s", FINGERPRINT)
    fill(tiny, store)
    aux = AuxStore(store, (1,))
    fill_aux(tiny, aux, worker=(1, 2))
    assert aux.done() == {1}
    fill_aux(tiny, aux)
    assert aux.done() == {0, 1, 2}
    data = read_union([store], (1,))
    for seq, feats in zip(data.sequences, data.aux):
        tiny.capture_layers((1,))
        step = prefill(tiny, KVCache(), seq.tolist() + [0])
        torch.testing.assert_close(feats.float(), step.target_aux[0].float(), atol=0.05, rtol=0.02)  # bf16 on disk
    batch = make_batch(data, [0, 1], 64)
    assert batch.aux.shape == (2, batch.tokens.shape[1], tiny.hidden_size)
    path = tmp_path / "s" / "aux-1" / "shard-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ShardError, match="aux file .*aux-1/shard-00001.safetensors is truncated or altered"):
        read_union([ShardStore(tmp_path / "s", FINGERPRINT)], (1,))
    with pytest.raises(ShardError, match="shard-00000.safetensors has no aux features for layers \\[3\\]"):
        read_union([store], (3,))


def test_rollouts_record_aux_features_equal_to_fill_aux_and_the_same_shards(tiny, tmp_path, monkeypatch):
    """fill_shards with an AuxStore records each shard's aux features from the rollout's own forwards:
    the same shards as without it, and the same features as fill_aux's prefill (bf16 rounding), so
    fill_aux finds nothing left to do."""
    from specdec.training.shards import AuxStore
    from specdec.training.eagle import fill_aux

    monkeypatch.setattr(tiny, "aux_layers", ())
    plain, during, after = (ShardStore(tmp_path / n, FINGERPRINT) for n in ("plain", "during", "after"))
    fill(tiny, plain)
    fill(tiny, during, aux_store=AuxStore(during, (1, 2)))
    fill(tiny, after)
    assert {i: v.sha256 for i, v in during.shards.items()} == {i: v.sha256 for i, v in plain.shards.items()}
    assert AuxStore(during, (1, 2)).done() == set(during.shards) == {0, 1, 2}
    fill_aux(tiny, AuxStore(after, (1, 2)))
    got, want = read_union([during], (1, 2)), read_union([after], (1, 2))
    assert len(got.aux) == len(PROMPTS)
    for a, b, seq in zip(got.aux, want.aux, got.sequences):
        assert a.shape == (seq.numel(), 2 * tiny.hidden_size)
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)
    assert not torch.equal(got.aux[0][:, :tiny.hidden_size], got.aux[0][:, tiny.hidden_size:])  # two layers, in order


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


def test_bench_eagle_teacher_forced_scores_heads_as_validation_does_with_their_aux_layers(tiny, tmp_path,
                                                                                          monkeypatch):
    """scripts/bench_eagle.py --teacher-forced: every head is scored by acceptance_per_depth on the
    target's greedy rollouts (equal to calling it directly); a fused head's batches carry the
    target's hidden states of its aux layers, a plain head's none."""
    import importlib.util
    import sys

    import specdec.training.eagle as training
    from specdec.drafters.eagle_head import widen

    spec = importlib.util.spec_from_file_location("bench_eagle", Path(__file__).resolve().parents[1] / "scripts" / "bench_eagle.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules["bench_eagle"] = script
    try:
        spec.loader.exec_module(script)
    finally:
        del sys.modules["bench_eagle"]
    plain = random_head(tiny).float()
    paths = {"plain": plain.save(tmp_path / "plain", dtype=torch.float32),
             "fused": widen(plain, (1,)).save(tmp_path / "fused", dtype=torch.float32)}
    seen = []

    def recording(head, embed, weight, vocab, batches, depth):
        seen.append(batches)
        return acceptance_per_depth(head, embed, weight, vocab, batches, depth)
    monkeypatch.setattr(training, "acceptance_per_depth", recording)
    got = script.teacher_forced(tiny, {k: str(v) for k, v in paths.items()}, PROMPTS[:4], 10, 3, None)
    data = rollout_batch(tiny, PROMPTS[:4], max_new_tokens=10, temperature=0.0)
    batch = make_batch(data, [0, 1, 2, 3], 10**6)
    want = acceptance_per_depth(EagleHead.load(paths["plain"]).float().eval(), tiny.base.get_input_embeddings(),
                                tiny.lm_head.weight.detach().float(), torch.arange(tiny.vocab_size), [batch], 3)
    assert got["plain"] == pytest.approx(want) and want["positions"] > 0
    (plain_batch,), (fused_batch,) = seen
    assert plain_batch.aux is None and torch.equal(plain_batch.tokens, batch.tokens)
    for row, seq in enumerate(data.sequences):
        with torch.inference_mode():
            states = tiny.base(input_ids=seq[None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(fused_batch.aux[row, :seq.numel()], states[1][0].float())
