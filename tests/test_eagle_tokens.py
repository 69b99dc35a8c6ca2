"""Token-shard rollout sets: round trip, a cut and resumed rollout equals an uncut one (no prompt twice,
none skipped), features recomputed from tokens equal the rollout's own, and bad input (another
target, other rollout settings, a truncated or altered shard, a set changed underneath a run, a
second writer) is an error naming the file. Tiny fp32 models only.
"""

import json
import os

import numpy as np
import pytest
import torch

import specdec
from specdec.training.eagle import make_batch, rollout_batch
from specdec.training.features import recompute, token_features, token_sequences
from specdec.training.prompts import user
from specdec.training.tokens import ShardError
from specdec.training.tokens import (LOCK, MANIFEST, TokenSet, fill_token_set, prompt_id, rollout_settings,
                                     set_checksum, target_identity)

PROMPTS = [("s-a", user(t)) for t in ["hi there", "what is 2+2?", "tell me a joke", "name a colour", "why?",
                                     "list three fruits", "say ok"]]
GREEDY = rollout_settings(temperature=0.0, seed=0, max_new_tokens=6)


@pytest.fixture(scope="module")
def tiny():
    return specdec.tiny_target("llama", dtype=torch.float32, seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def identity(tiny):
    return target_identity(tiny)


def fill(tiny, root, identity, prompts=PROMPTS, settings=GREEDY, **kw):
    tset = TokenSet(root, identity, settings)
    fill_token_set(tiny, tset, prompts, shard_prompts=3, batch_size=2, log=lambda s: None, **kw)
    return tset


def contents(tset):
    return [(s.prompt_id, s.source, s.prompt_len, s.tokens.tolist()) for s in token_sequences([tset])]


def test_a_set_round_trips_and_holds_every_prompt_once_as_the_rollout_made_it(tiny, identity, tmp_path):
    tset = fill(tiny, tmp_path / "set", identity)
    assert len(tset.shards) == 3 and sorted(tset.done()) == sorted(prompt_id(p) for _, p in PROMPTS)
    reopened = TokenSet(tmp_path / "set", identity, GREEDY)
    seqs = token_sequences([reopened])
    assert [s.prompt_id for s in seqs] == [prompt_id(p) for _, p in PROMPTS]
    direct = rollout_batch(tiny, [p for _, p in PROMPTS], max_new_tokens=6, temperature=0.0)
    assert [s.tokens.tolist() for s in seqs] == [s.tolist() for s in direct.sequences]
    assert [s.prompt_len for s in seqs] == direct.prompt_len
    for info in reopened.shards:  # 2 bytes a token, raw little-endian
        raw = np.fromfile(tmp_path / "set" / info.file, dtype="<u2")
        assert raw.size == info.num_tokens and info.bytes == 2 * info.num_tokens
    manifest = json.loads((tmp_path / "set" / MANIFEST).read_text())
    assert manifest["target"] == identity and manifest["rollout"]["mode"] == "greedy"
    assert manifest["runs"][0]["shards"] == 3 and manifest["runs"][0]["tokens"] == reopened.num_tokens


def test_a_cut_rollout_resumed_equals_an_uncut_one_and_a_longer_list_only_adds(tiny, identity, tmp_path):
    whole = fill(tiny, tmp_path / "whole", identity)
    cut = fill(tiny, tmp_path / "cut", identity, max_shards=1)
    assert len(cut.shards) == 1
    fill(tiny, tmp_path / "cut", identity, max_shards=1)
    resumed = fill(tiny, tmp_path / "cut", identity)
    assert contents(resumed) == contents(whole)
    more = PROMPTS[:2] + [("s-b", user("one more prompt"))] + PROMPTS[2:]
    grown = fill(tiny, tmp_path / "cut", identity, prompts=more)
    ids = [s.prompt_id for s in token_sequences([grown])]
    assert len(ids) == len(set(ids)) == len(more) and ids[-1] == prompt_id(user("one more prompt"))
    assert set_checksum([grown]) != set_checksum([whole])
    assert set_checksum([TokenSet(tmp_path / "whole", identity, GREEDY)]) == set_checksum([whole])


def test_another_target_or_other_settings_are_errors_naming_the_manifest(tiny, identity, tmp_path):
    fill(tiny, tmp_path / "set", identity, max_shards=1)
    other = target_identity(specdec.tiny_target("llama", dtype=torch.float32, seed=1, logit_scale=4.0))
    assert other["weights_sha256"] != identity["weights_sha256"]
    with pytest.raises(ShardError, match=rf"{tmp_path / 'set' / MANIFEST}.*another target.*weights_sha256"):
        TokenSet(tmp_path / "set", other, GREEDY)
    with pytest.raises(ShardError, match=rf"{tmp_path / 'set' / MANIFEST}.*another rollout.*temperature"):
        TokenSet(tmp_path / "set", identity, rollout_settings(temperature=0.7, seed=0, max_new_tokens=6))
    with pytest.raises(ShardError, match=rf"{tmp_path / 'set' / MANIFEST}.*names another target"):
        token_features(tiny, [TokenSet.open(tmp_path / "set")], (), tmp_path / "cache", identity=other)


def test_a_truncated_altered_or_missing_shard_is_an_error_naming_it(tiny, identity, tmp_path):
    tset = fill(tiny, tmp_path / "set", identity, max_shards=2)
    path = tmp_path / "set" / tset.shards[1].file
    data = path.read_bytes()
    path.write_bytes(data[:-2])
    with pytest.raises(ShardError, match=rf"{path} is truncated"):
        TokenSet(tmp_path / "set", identity, GREEDY)
    path.write_bytes(data[:-2] + bytes([data[-2] ^ 1, data[-1]]))
    with pytest.raises(ShardError, match=rf"{path} is corrupt"):
        TokenSet.open(tmp_path / "set")
    with pytest.raises(ShardError, match=rf"{path} is corrupt"):
        token_sequences([tset])
    path.unlink()
    with pytest.raises(ShardError, match=rf"{path} is recorded .* but missing"):
        TokenSet(tmp_path / "set", identity, GREEDY)


def test_a_set_changed_underneath_a_run_or_held_by_another_writer_is_refused(tiny, identity, tmp_path):
    first = fill(tiny, tmp_path / "set", identity, max_shards=1)
    second = fill(tiny, tmp_path / "set", identity, max_shards=1)  # appends while `first` is open
    with pytest.raises(ShardError, match=rf"{tmp_path / 'set' / MANIFEST} changed underneath"):
        fill_token_set(tiny, first, PROMPTS, shard_prompts=3, batch_size=2, log=lambda s: None)
    assert len(TokenSet(tmp_path / "set", identity, GREEDY).shards) == len(second.shards) == 2
    lock = tmp_path / "set" / LOCK
    lock.write_text(str(os.getppid()))  # a live process
    with pytest.raises(ShardError, match=rf"{lock} is held by process"):
        fill_token_set(tiny, second, PROMPTS, shard_prompts=3, batch_size=2, log=lambda s: None)
    lock.write_text("999999999")  # a dead one: its lock is taken over and released
    fill_token_set(tiny, second, PROMPTS, shard_prompts=3, batch_size=2, log=lambda s: None)
    assert not lock.exists() and len(second.done()) == len(PROMPTS)
    with pytest.raises(ShardError, match="outside `with tset.writing"):
        second.append([torch.tensor([1, 2])], ["new"], ["s-a"], [1], {"started": "x"})
    with second.writing(), pytest.raises(ShardError, match="already in"):
        second.append([torch.tensor([1, 2])], [prompt_id(PROMPTS[0][1])], ["s-a"], [1], {"started": "x"})


def test_token_ids_beyond_uint16_are_refused(tiny, identity, tmp_path):
    tset = TokenSet(tmp_path / "set", identity, GREEDY)
    with tset.writing(), pytest.raises(ShardError, match="do not fit uint16"):
        tset.append([torch.tensor([1, 70000])], ["x"], ["s"], [1], {"started": "x", "started_unix": 0.0})


def test_features_recomputed_from_tokens_equal_the_rollouts_and_feed_training_batches(tiny, identity, tmp_path):
    tset = fill(tiny, tmp_path / "set", identity)
    direct = rollout_batch(tiny, [p for _, p in PROMPTS], max_new_tokens=6, temperature=0.0)
    data = token_features(tiny, [tset], layers=(1,), cache_dir=tmp_path / "fresh", identity=identity)
    assert [s.tolist() for s in data.sequences] == [s.tolist() for s in direct.sequences]
    for got, want in zip(data.hidden, direct.hidden):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    hidden, _ = recompute(tiny, data.sequences[0])
    assert hidden.shape == (data.sequences[0].numel(), tiny.hidden_size)
    torch.testing.assert_close(hidden, direct.hidden[0], atol=1e-4, rtol=1e-4)  # the prefill = the KV-cached steps
    weight = torch.ones(tiny.hidden_size, requires_grad=True)
    (hidden * weight).sum().backward()  # usable as a training input (not an inference-mode tensor)
    assert weight.grad is not None
    batch = make_batch(data, [0, 1, 2], max_len=64)
    assert batch.aux is not None and int(batch.generated.sum()) == sum(
        data.sequences[r].numel() - data.prompt_len[r] for r in range(3))
    cached = token_features(tiny, [tset], layers=(1,), cache_dir=tmp_path / "cache", identity=identity)
    files = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(files) == len(tset.shards)
    again = token_features(tiny, [tset], layers=(1,), cache_dir=tmp_path / "cache", identity=identity)
    for a, b, c in zip(cached.hidden, again.hidden, data.hidden):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_sampled_set_cut_and_resumed_equals_an_uncut_one(tiny, identity, tmp_path):
    sampled = rollout_settings(temperature=1.0, seed=5, max_new_tokens=6)
    whole = fill(tiny, tmp_path / "whole", identity, settings=sampled)
    fill(tiny, tmp_path / "cut", identity, settings=sampled, max_shards=1)
    resumed = fill(tiny, tmp_path / "cut", identity, settings=sampled)
    assert contents(resumed) == contents(whole) and whole.rollout["mode"] == "sampled"
    other_seed = fill(tiny, tmp_path / "seed6", identity, settings=rollout_settings(temperature=1.0, seed=6,
                                                                                      max_new_tokens=6))
    assert contents(other_seed) != contents(whole)
    assert all(s.temperature == 1.0 for s in token_sequences([whole]))
