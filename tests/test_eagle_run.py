"""One resumable EAGLE training run (specdec/training/run.py): a run cut anywhere and resumed from its
checkpoint ends in exactly the state and curve of an uncut run; the schedule is warm-up, constant,
anneal; the loss can be masked to generated positions; validation is chosen by prompt id; resuming
with other settings, another head geometry or another shard set is an error naming the checkpoint.
Tiny fp32 models, a few steps.
"""

import json

import pytest
import torch

import specdec
from specdec.drafters.eagle import random_head
from specdec.drafters.eagle_head import HeadConfig, widen
from specdec.training.eagle import depth_losses, make_batch, rollout_batch, unroll
from specdec.training.run import Run, RunConfig, advance, lr_factor, trim_curve, validation_prompts
from specdec.training.tokens import ShardError

CFG = RunConfig(lr=1e-3, warmup_steps=2, anneal_start=5, max_steps=8, batch_size=2, max_len=24, ttt_depth=3,
                ce_vocab=64, eval_vocab=64, val_depth=3, feature_noise=0.1)


@pytest.fixture(scope="module")
def tiny():
    return specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def data(tiny):
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [2, 9, 4, 4], [7, 1], [1, 1, 2, 3, 5, 8], [13, 2], [6, 6, 6]]
    return rollout_batch(tiny, prompts, max_new_tokens=10, temperature=0.0)


def fresh(tiny, cfg=CFG):
    return Run(cfg, random_head(tiny, seed=3), tiny, "sum-a", ["p0", "p1"])


def train(run, data, tmp, until, deadline=float("inf")):
    val = [make_batch(data, [6, 7], 24)]
    return advance(run, data, list(range(6)), val, until=until, val_every=3, checkpoint=tmp / "run.pt",
                   curve=tmp / "curve.jsonl", deadline=deadline)


def points(path):
    return [{k: v for k, v in json.loads(ln).items() if k != "time"} for ln in path.read_text().splitlines()]


def test_a_run_cut_and_resumed_equals_an_uncut_run(tiny, data, tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    uncut = fresh(tiny)
    assert train(uncut, data, tmp_path / "a", CFG.max_steps)
    cut = fresh(tiny)
    assert not train(cut, data, tmp_path / "b", CFG.max_steps, deadline=0.0)  # stops after one step
    assert cut.step == 1
    for _ in range(2):  # resumed twice: once mid-way between curve points, once after a point
        run = Run.resume(tmp_path / "b" / "run.pt", tiny, CFG, "sum-a", HeadConfig.for_target(tiny))
        trim_curve(tmp_path / "b" / "curve.jsonl", run.step)
        train(run, data, tmp_path / "b", 4)
    run = Run.resume(tmp_path / "b" / "run.pt", tiny, CFG, "sum-a", HeadConfig.for_target(tiny))
    with open(tmp_path / "b" / "curve.jsonl", "a") as f:  # a point written just before a cut, never saved
        f.write(json.dumps({"step": 7}) + "\n")
    trim_curve(tmp_path / "b" / "curve.jsonl", run.step)
    assert train(run, data, tmp_path / "b", CFG.max_steps)
    assert run.step == uncut.step == CFG.max_steps
    for (name, a), b in zip(uncut.head.state_dict().items(), run.head.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(uncut.opt.state_dict()["state"][0]["exp_avg_sq"], run.opt.state_dict()["state"][0]["exp_avg_sq"])
    assert points(tmp_path / "a" / "curve.jsonl") == points(tmp_path / "b" / "curve.jsonl")
    assert [p["step"] for p in points(tmp_path / "a" / "curve.jsonl")] == [3, 6, 8]
    assert uncut.best == run.best and uncut.best["step"] in (3, 6, 8)
    assert fresh(tiny).head.state_dict()["fc.weight"].ne(run.head.state_dict()["fc.weight"]).any()


def test_the_compact_state_kept_in_the_repository_resumes_the_run_close_to_the_full_state(tiny, data, tmp_path):
    """`save(compact=True)` keeps the head and AdamW's moments in bf16: half the size; resuming from it continues at the same step, batch order and schedule, and
    ends near the run resumed from the full state (what the compaction costs is one bf16 rounding)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    run = fresh(tiny)
    assert train(run, data, tmp_path / "a", 4)
    full, small = run.save(tmp_path / "a" / "run.pt"), run.save(tmp_path / "b" / "run.pt", compact=True)
    assert small.stat().st_size < 0.6 * full.stat().st_size
    assert Run.saved_step(small) == Run.saved_step(full) == 4 and Run.saved_step(tmp_path / "none.pt") == -1
    a = Run.resume(full, tiny, CFG, "sum-a", HeadConfig.for_target(tiny))
    b = Run.resume(small, tiny, CFG, "sum-a", HeadConfig.for_target(tiny))
    assert (a.step, a.order, a.best) == (b.step, b.order, b.best)
    for (name, x), y in zip(a.head.state_dict().items(), b.head.state_dict().values()):
        assert y.dtype == torch.float32 and torch.equal(x.to(torch.bfloat16).float() if x.dim() > 1 else x, y), name
    state = b.opt.state_dict()["state"][0]
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[name], a.opt.state_dict()["state"][0][name].to(torch.bfloat16).float())
    assert train(a, data, tmp_path / "a", CFG.max_steps) and train(b, data, tmp_path / "b", CFG.max_steps)
    for (name, x), y in zip(a.head.state_dict().items(), b.head.state_dict().values()):
        moved = (x - fresh(tiny).head.state_dict()[name]).norm()
        assert (x - y).norm() < 0.05 * moved + 1e-6, name  # close, but not equal: the compaction is lossy
    assert any(not torch.equal(x, y) for x, y in zip(a.head.state_dict().values(), b.head.state_dict().values()))


def test_resuming_with_other_settings_head_or_data_is_an_error_naming_the_checkpoint(tiny, data, tmp_path):
    run = fresh(tiny)
    train(run, data, tmp_path, 3)
    path = tmp_path / "run.pt"
    expected = HeadConfig.for_target(tiny)
    with pytest.raises(ShardError, match=rf"{path} trained on shard set .* changed underneath"):
        Run.resume(path, tiny, CFG, "sum-b", expected)
    with pytest.raises(ValueError, match=rf"{path} was trained with other settings.*'lr'"):
        Run.resume(path, tiny, RunConfig(**{**CFG.__dict__, "lr": 2e-3}), "sum-a", expected)
    with pytest.raises(ValueError, match=rf"{path} holds a head for another target or head configuration"):
        Run.resume(path, tiny, CFG, "sum-a", HeadConfig.for_target(tiny, aux_layers=(1,)))
    longer = RunConfig(**{**CFG.__dict__, "anneal_start": 20, "max_steps": 30})  # still in the constant phase
    assert Run.resume(path, tiny, longer, "sum-a", expected).step == 3
    train(Run.resume(path, tiny, CFG, "sum-a", expected), data, tmp_path, 6)  # now past anneal_start = 5
    with pytest.raises(ValueError, match=rf"{path} is at step 6, past anneal_start"):
        Run.resume(path, tiny, longer, "sum-a", expected)


def test_the_schedule_warms_up_holds_then_anneals():
    cfg = RunConfig(warmup_steps=10, anneal_start=100, max_steps=200)
    assert lr_factor(4, cfg) == pytest.approx(0.5) and lr_factor(9, cfg) == lr_factor(99, cfg) == 1.0
    assert lr_factor(150, cfg) == pytest.approx(0.5) and lr_factor(200, cfg) == pytest.approx(0.0)
    longer = RunConfig(warmup_steps=10, anneal_start=300, max_steps=400)
    assert all(lr_factor(s, cfg) == lr_factor(s, longer) for s in range(100))  # extending keeps the past
    with pytest.raises(ValueError, match="anneal_start <= max_steps"):
        RunConfig(anneal_start=10, max_steps=5)


def test_the_generated_only_loss_never_scores_prompt_positions(tiny, data):
    """Targets h_i with i < prompt_len - 1 predict a prompt token: moving them changes the full loss
    and leaves the generated-only loss as it was (the head's predictions held fixed)."""
    head = random_head(tiny, seed=1)
    batch = make_batch(data, [0, 5], 24)  # prompts of 5 and 6 tokens
    rows = tiny.lm_head.weight.detach()
    predicted = [p.detach() for p in unroll(head, tiny.base.get_input_embeddings(), batch, 3)]
    full, _ = depth_losses(predicted, batch, rows, ce_weight=0.1)
    masked, _ = depth_losses(predicted, batch, rows, ce_weight=0.1, generated_only=True)
    batch.hidden[:, :4] += 5.0
    moved_full, _ = depth_losses(predicted, batch, rows, ce_weight=0.1)
    moved_masked, _ = depth_losses(predicted, batch, rows, ce_weight=0.1, generated_only=True)
    assert moved_full.item() != pytest.approx(full.item())
    assert moved_masked.item() == pytest.approx(masked.item(), rel=1e-6)
    assert masked.item() != pytest.approx(full.item())


def test_validation_prompts_are_chosen_by_id_whatever_the_order_or_growth():
    ids = [f"p{i}" for i in range(40)]
    chosen = validation_prompts(ids, [0.0] * 40, 24)
    assert len(chosen) == 24 and validation_prompts(ids[::-1], [0.0] * 40, 24) == chosen
    assert validation_prompts(ids + ids[:5], [0.0] * 40 + [0.7] * 5, 24) == chosen
    assert not set(validation_prompts(ids, [0.7] * 20 + [0.0] * 20, 20)) & set(ids[:20])
    with pytest.raises(ValueError, match="needs 24 prompts with a greedy sequence, the data has 20"):
        validation_prompts(ids, [0.7] * 20 + [0.0] * 20, 24)


def test_the_commands_roll_out_train_cut_and_resume_on_a_token_set(tmp_path, monkeypatch):
    """`python -m specdec.training rollout` then `run` on tiny-llama: the run starts with a
    step-0 point, resumes only when asked, continues its curve, and refuses a grown shard set."""
    from specdec.training import cli
    from specdec.training.prompts import SOURCES, user

    # the tiny tokenizer has no chat template, so single-turn prompts only
    texts = [f"please tell me about the quick brown fox number {i}" if i % 4 == 0 else f"zq{i} xv{i * 7} kw"
             for i in range(60)]  # every 4th shares an 8-word run with the others of its kind
    monkeypatch.setitem(SOURCES, "test-single", lambda n, seed: [user(t) for t in texts][:n])
    data = str(tmp_path / "set")
    roll = ["--target", "tiny-llama", "--sources", "test-single", "--out", data, "--shard-prompts", "16",
            "--batch-size", "8", "--max-new-tokens", "8", "--max-shards", "2"]
    assert cli.rollout(roll)["prompts_done"] == 32
    train = ["--target", "tiny-llama", "--sets", data, "--out", str(tmp_path / "run"), "--curve",
             str(tmp_path / "curve.jsonl"), "--feature-cache", str(tmp_path / "features"), "--num-validation", "24",
             "--val-every", "2", "--batch-size", "2", "--max-len", "32", "--ttt-depth", "2", "--warmup-steps", "1",
             "--anneal-start", "4", "--max-steps", "6", "--keep", str(tmp_path / "kept.pt")]
    first = cli.run(train + ["--steps", "3"])
    assert first["step"] == 3 and first["val_sequences"] == 24
    assert first["dropped_near_val"] > 0 and first["train_sequences"] + first["dropped_near_val"] == 8
    with pytest.raises(SystemExit, match="run.pt exists: pass --resume"):
        cli.run(train)
    assert Run.saved_step(tmp_path / "kept.pt") == 3  # the compact copy, written when the session ended
    (tmp_path / "run" / "run.pt").unlink()  # another machine: only the repository's copy is there
    assert cli.run(train + ["--steps", "5", "--resume"])["step"] == 6
    assert [json.loads(ln)["step"] for ln in (tmp_path / "curve.jsonl").read_text().splitlines()] == [0, 2, 4, 6]
    cli.rollout(roll[:-1] + ["1"])  # the set grows by a shard
    with pytest.raises(ShardError, match=r"run.pt trained on shard set .* changed underneath"):
        cli.run(train + ["--resume"])
    grown = cli.run(train + ["--resume", "--grow"])  # at max_steps already: accepted, nothing to train
    assert grown["step"] == 6 and grown["train_sequences"] + grown["dropped_near_val"] == 8 + 16

    # an A/B arm: a new run from the saved state with another loss, its own --out and curve, no kept state
    fork = ["--target", "tiny-llama", "--sets", data, "--curve", str(tmp_path / "fork.jsonl"), "--feature-cache",
            str(tmp_path / "features"), "--num-validation", "24", "--val-every", "2", "--batch-size", "2", "--max-len",
            "32", "--ttt-depth", "2", "--warmup-steps", "1", "--anneal-start", "4", "--max-steps", "10", "--grow"]
    # (the resume below names its --keep: the default is the repository's state)
    with pytest.raises(ValueError, match="only anneal_start and max_steps may change"):
        cli.run(fork + ["--out", str(tmp_path / "run"), "--resume", "--ce-weight", "1.0", "--keep", ""])
    with pytest.raises(SystemExit, match="--fork starts a new run"):
        cli.run(fork + ["--out", str(tmp_path / "run"), "--fork", str(tmp_path / "run" / "run.pt")])
    arm = cli.run(fork + ["--out", str(tmp_path / "arm"), "--fork", str(tmp_path / "run" / "run.pt"),
                               "--ce-weight", "1.0", "--steps", "2"])
    assert arm["step"] == 8 and not (tmp_path / "arm" / "kept.pt").exists()
    state = torch.load(tmp_path / "arm" / "run.pt", weights_only=False, map_location="cpu")
    assert state["config"]["ce_weight"] == 1.0 and state["best"]["step"] == 6
    assert state["data_history"][-2]["changed"] == {"ce_weight": (0.1, 1.0)}  # then the growth, at the same step
    assert Run.saved_step(tmp_path / "kept.pt") == 6  # the forked run's kept state untouched


def test_validation_in_bf16_scores_a_bf16_copy_and_leaves_the_trained_head_fp32(tiny, data):
    bf16 = Run(RunConfig(**{**CFG.__dict__, "val_dtype": "bfloat16"}), random_head(tiny, seed=3), tiny, "s", [])
    fp32 = fresh(tiny)
    val = [make_batch(data, [5, 6, 7], 24)]
    a, b = bf16.validate(val), fp32.validate(val)
    assert a["positions"] == b["positions"] > 0 and 1.0 <= a["chain_mal"] <= 1 + CFG.val_depth
    assert all(p.dtype == torch.float32 for p in bf16.head.parameters())
    from specdec.training.eagle import acceptance_per_depth
    import copy
    cast = copy.deepcopy(bf16.head).to(torch.bfloat16).eval()
    assert acceptance_per_depth(cast, bf16.embed, bf16.eval_rows, bf16.eval_vocab, val, CFG.val_depth) == a
    with pytest.raises(ValueError, match="val_dtype must be"):
        RunConfig(val_dtype="int8")


def test_training_on_features_left_on_disk_equals_training_in_memory(tmp_path):
    """token_features with one shard resident at a time and with every shard resident give the same
    batches, so the same run state after the same steps."""
    from specdec.training.features import token_features
    from specdec.training.prompts import user
    from specdec.training.tokens import TokenSet, fill_token_set, rollout_settings, target_identity

    tiny = specdec.tiny_target("llama", dtype=torch.float32, seed=0, logit_scale=4.0)
    identity = target_identity(tiny)
    tset = TokenSet(tmp_path / "set", identity, rollout_settings(temperature=0.0, seed=0, max_new_tokens=6))
    fill_token_set(tiny, tset, [("s", user(f"q{i} about w{i}")) for i in range(12)], shard_prompts=3, batch_size=3,
                   log=lambda s: None)
    memory = token_features(tiny, [tset], (1,), tmp_path / "cache", identity, resident=len(tset.shards))
    disk = token_features(tiny, [tset], (1,), tmp_path / "cache", identity, resident=1)
    for rows in ([0, 11, 4], [7, 1]):
        a, b = make_batch(memory, rows, 24), make_batch(disk, rows, 24)
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.aux, b.aux) and torch.equal(a.tokens, b.tokens)
    assert len(disk._loaded) == 1
    cfg = RunConfig(**{**CFG.__dict__, "ce_vocab": 258, "eval_vocab": 258})
    runs = []
    for data in (memory, disk):
        run = Run(cfg, widen(random_head(tiny, seed=3), (1,)), tiny, "s", [])
        for _ in range(4):
            run.train_step(data, list(range(10)))
        runs.append(run)
    for a, b in zip(runs[0].head.state_dict().values(), runs[1].head.state_dict().values()):
        assert torch.equal(a, b)
    disk.files[0][0].write_bytes(b"not a safetensors file")
    disk._loaded.clear()
    with pytest.raises(ShardError, match=rf"feature cache file {disk.files[0][0]} cannot be read"):
        disk.hidden[0]


def test_a_run_resumes_on_grown_sets_only_when_asked_and_only_if_they_only_grew(tiny, data, tmp_path):
    run = Run(CFG, random_head(tiny, seed=3), tiny, "A", ["p0"], [["s1", "s2"]])
    train(run, data, tmp_path, 2)
    path, expected = tmp_path / "run.pt", HeadConfig.for_target(tiny)
    with pytest.raises(ShardError, match="changed underneath.*pass grow"):
        Run.resume(path, tiny, CFG, "B", expected, [["s1", "s2", "s3"]])
    with pytest.raises(ShardError, match="changed underneath"):
        Run.resume(path, tiny, CFG, "B", expected, [["s1", "sX", "s3"]], grow=True)
    with pytest.raises(ShardError, match="changed underneath"):
        Run.resume(path, tiny, CFG, "B", expected, [["s1", "s2"], ["t1"]], grow=True)
    grown = Run.resume(path, tiny, CFG, "B", expected, [["s1", "s2", "s3"]], grow=True)
    assert grown.data_history == [{"step": 2, "from": "A", "to": "B"}] and grown.step == 2
    order = list(grown.order)
    train(grown, data, tmp_path, 3)  # the current permutation runs out before the new rows join
    assert grown.order == order[CFG.batch_size:]
    assert Run.resume(path, tiny, CFG, "B", expected, [["s1", "s2", "s3"]]).data_history == grown.data_history


def test_a_padded_batch_recomputes_each_sequence_s_own_features():
    """recompute_batch (the accelerator path of the feature cache) equals recompute one sequence at a
    time, up to rounding: the padding after a shorter sequence never reaches its states."""
    from specdec.training.features import recompute, recompute_batch

    tiny = specdec.tiny_target("llama", dtype=torch.float32, seed=0, logit_scale=4.0)
    seqs = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 17, 11)]
    for tokens, (h, a) in zip(seqs, recompute_batch(tiny, seqs, (1,))):
        h1, a1 = recompute(tiny, tokens, (1,))
        assert h.shape == h1.shape and a.shape == a1.shape
        torch.testing.assert_close(h, h1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.float(), a1.float(), atol=1e-2, rtol=1e-2)
    shifted = recompute_batch(tiny, [seqs[0], torch.cat([seqs[1][:4], seqs[1][4:] + 1])], (1,))[0][0]
    torch.testing.assert_close(shifted, recompute_batch(tiny, seqs, (1,))[0][0], atol=1e-5, rtol=1e-5)


def test_the_run_page_counts_compute_per_device_and_cuts_sessions_at_long_gaps():
    from specdec.training import page
    point = lambda step, t, device: {"step": step, "time": f"2026-12-04T{t}+0000", "device": device}  # noqa: E731
    curve = [point(0, "10:00:00", "cpu"), point(100, "10:30:00", "cpu"), point(200, "13:00:00", "cpu"),
             point(300, "13:10:00", "cpu"), point(1000, "13:11:00", "gpu"), point(2000, "13:12:40", "gpu")]
    got = page.compute_by_device(curve)
    assert got == {"cpu": {"seconds": 2400.0, "steps": 200}, "gpu": {"seconds": 160.0, "steps": 1700}}


def test_the_run_page_shows_each_run_after_the_first_as_its_own_section():
    from pathlib import Path

    from specdec.training import page
    assert [page.run_name(Path(p)) for p in ("data/eagle/curve.jsonl", "data/eagle/curve-run2.jsonl")] == ["run 1", "run2"]
    point = lambda step, mal: {"step": step, "time": f"2026-12-04T10:0{step}:00+0000", "device": "cpu", "lr": 1e-4,  # noqa: E731
                               "val": {"chain_mal": mal, "acc@1": 0.5}}
    text = page.render({"run 1": [point(0, 2.0), point(1, 2.5)], "run2": [point(0, 2.4), point(1, 2.6)]}, {})
    assert "## Run 1" in text and "## Run2" in text
    assert "Best validation chain MAL: step 1, 2.500." in text and "Best validation chain MAL: step 1, 2.600." in text
