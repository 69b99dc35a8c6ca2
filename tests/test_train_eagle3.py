"""Training an EAGLE-3 head (specdec/training/eagle3.py, `python -m specdec.training eagle3`): the loss falls and
greedy acceptance rises above the untrained head's; the loss is scored against the target's own
distribution (a head trained against shuffled teacher columns does worse); the saved speculators
directory loads back and drafts exactly what the in-memory head drafts; its speculators export round-trips
(same tensors, steps and MAL, outputs equal to the plain loop's). Tiny fp32 models, a few steps."""

import pytest
import torch
import torch.nn.functional as F

import specdec
from specdec.drafters import build
from specdec.drafters.eagle_head import rank_vocabulary
from specdec.drafters.speculators_format import load_speculators, save_speculators
from specdec.training.eagle import make_batch, rollout_batch, unroll
from specdec.training.eagle3 import (eagle3_acceptance, eagle3_loss, new_eagle3_head, scored_targets, teacher_rows,
                                     train_step)
from specdec.training.features import recompute

AUX, DEPTH, STEPS = (0, 1), 3, 60


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=0, logit_scale=4.0)


@pytest.fixture(scope="module")
def batches(tiny):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(24)]
    data = rollout_batch(tiny, prompts, max_new_tokens=16, temperature=0.0)
    data.aux = [recompute(tiny, seq, AUX)[1] for seq in data.sequences]
    vocab = rank_vocabulary(torch.cat(data.sequences), 64)[:48]
    return vocab, [make_batch(data, list(range(i, i + 8)), 32) for i in range(0, 24, 8)]


def fresh(tiny, vocab):
    return new_eagle3_head(tiny, AUX, vocab, seed=1)


def train(tiny, head, batches, rows=None, steps=STEPS):
    embed = tiny.base.get_input_embeddings()
    rows = teacher_rows(tiny, head) if rows is None else rows
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for step in range(steps):
        train_step(head, embed, batches[step % len(batches)], opt, rows, depth=DEPTH)
    return head.eval()


@pytest.fixture(scope="module")
def trained(tiny, batches):
    return train(tiny, fresh(tiny, batches[0]), batches[1])


def excess_loss(tiny, head, batches):
    """Mean loss minus its floor (the loss a head matching the target's distribution gets: the teacher's entropy)."""
    embed, rows = tiny.base.get_input_embeddings(), teacher_rows(tiny, head)
    total = 0.0
    with torch.no_grad():
        for b in batches:
            targets = scored_targets(b, DEPTH)
            entropy = sum(torch.distributions.Categorical(logits=F.linear(h[use], rows)).entropy().sum()
                          for h, use in targets) / targets[0][1].sum()
            total += float(eagle3_loss(head, unroll(head, embed, b, DEPTH), b, rows)[0] - entropy)
    return total / len(batches)


def test_a_new_head_has_the_targets_geometry_and_lm_head_rows(tiny, batches):
    vocab, _ = batches
    head = fresh(tiny, vocab)
    layer = head.config.layer_config
    text = tiny.model.config
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["intermediate_size"]
            ) == (text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.intermediate_size)
    assert layer["num_hidden_layers"] == 1 and head.config.aux_layers == AUX and torch.equal(head.draft_vocab, vocab)
    assert torch.equal(head.lm_head.weight, tiny.lm_head.weight[vocab])
    with pytest.raises(ValueError, match="repeated target ids"):
        new_eagle3_head(tiny, AUX, torch.tensor([3, 4, 3]))


def test_training_lowers_the_loss_and_raises_greedy_acceptance(tiny, batches, trained):
    vocab, data = batches
    untrained = fresh(tiny, vocab)
    embed = tiny.base.get_input_embeddings()
    assert 0 <= excess_loss(tiny, trained, data) < 0.5 * excess_loss(tiny, untrained, data)
    before = eagle3_acceptance(untrained, embed, data, DEPTH)
    after = eagle3_acceptance(trained, embed, data, DEPTH)
    assert after["positions"] == before["positions"] > 100
    assert after["chain_mal"] > before["chain_mal"] + 0.3 and after["acc@1"] > before["acc@1"] + 0.2


def test_the_loss_is_scored_against_the_targets_distribution(tiny, batches, trained):
    """A head trained against the target's rows shuffled over the draft columns (each column's teacher
    probability is another token's) drafts the wrong tokens: far lower acceptance."""
    vocab, data = batches
    head = fresh(tiny, vocab)
    rows = teacher_rows(tiny, head)
    shuffled = train(tiny, head, data, rows=rows[torch.randperm(len(vocab), generator=torch.Generator().manual_seed(2))])
    embed = tiny.base.get_input_embeddings()
    assert (eagle3_acceptance(shuffled, embed, data, DEPTH)["chain_mal"] + 0.3
            < eagle3_acceptance(trained, embed, data, DEPTH)["chain_mal"])


def test_prompt_positions_are_never_scored(tiny, batches):
    """The teacher at depth s is h_{j+s}, counted only where t_{j+s+1} is generated: moving the target's
    features h_i with i < prompt_len - 1 (their next token is a prompt token) leaves the loss unchanged;
    moving h_{prompt_len - 1} (its next token is the first generated one) changes it."""
    vocab, data = batches
    head, batch = fresh(tiny, vocab), data[0]
    embed, rows = tiny.base.get_input_embeddings(), teacher_rows(tiny, head)
    first = batch.generated.float().argmax(-1)  # [B] prompt_len of each row
    assert bool(batch.generated.any(-1).all()) and int(first.min()) >= 2
    with torch.no_grad():
        predicted = unroll(head, embed, batch, DEPTH)  # fixed: only the teacher's features move below
        loss = eagle3_loss(head, predicted, batch, rows)[0]
        for shift, moves in ((0, False), (1, True)):
            hidden = batch.hidden.clone()
            for b, n in enumerate(first.tolist()):
                hidden[b, : n - 1 + shift] += 5.0
            moved = eagle3_loss(head, predicted, type(batch)(**{**batch.__dict__, "hidden": hidden}), rows)[0]
            assert bool(moved != loss) == moves


def test_the_saved_directory_drafts_what_the_head_in_memory_drafts(tiny, batches, trained, tmp_path):
    save_speculators(trained, tmp_path / "head", dtype=torch.float32, embedding=tiny.base.get_input_embeddings().weight)
    again = load_speculators(tmp_path / "head")
    assert again.config == trained.config and torch.equal(again.draft_vocab, trained.draft_vocab)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in trained.state_dict().items())
    memory = build("eagle", target=tiny, head=trained, head_dtype=torch.float32)
    disk = build("eagle", target=tiny, head=tmp_path / "head", head_dtype=torch.float32)
    accepted = 0
    for prompt in ([5, 9, 13, 2, 7], [3, 1], [8, 8, 4, 2, 6, 1, 9, 9]):
        plain = specdec.generate(tiny, None, prompt, max_new_tokens=20, stop_on_eos=False).token_ids
        for shape in ("chain(4)", "dynamic(top_k=4,depth=4,budget=10)"):
            a = specdec.generate(tiny, memory, prompt, shape=shape, max_new_tokens=20, stop_on_eos=False)
            b = specdec.generate(tiny, disk, prompt, shape=shape, max_new_tokens=20, stop_on_eos=False)
            assert a.token_ids == b.token_ids == plain
            assert [s.accepted for s in a.stats.steps] == [s.accepted for s in b.stats.steps]
            accepted += sum(s.accepted for s in a.stats.steps)
    assert accepted > 0  # the drafts compared are ones the target accepts, not only rejected noise


@pytest.fixture(scope="module")
def command_head(tmp_path_factory):
    """`python -m specdec.training eagle3` on a tiny-llama token set: (its summary, its folder)."""
    from specdec.training import eagle3
    from specdec.training.prompts import SOURCES, user
    from specdec.training.tokens import TokenSet, fill_token_set, rollout_settings, target_identity

    tmp_path = tmp_path_factory.mktemp("eagle3")
    texts = [f"zq{i} xv{i * 7} kw{i % 5}" for i in range(20)]
    SOURCES["test-eagle3"] = lambda n, seed: [user(t) for t in texts][:n]
    try:
        target = specdec.load_target("tiny-llama")
        tset = TokenSet(tmp_path / "set", target_identity(target),
                        rollout_settings(temperature=0.0, seed=0, max_new_tokens=8))
        fill_token_set(target, tset, [("test-eagle3", user(t)) for t in texts], shard_prompts=10, batch_size=10,
                       log=lambda s: None)
        summary = eagle3.main(["--target", "tiny-llama", "--sets", str(tmp_path / "set"), "--feature-cache",
                               str(tmp_path / "features"), "--aux-layers", "0", "1", "--draft-vocab-size", "40",
                               "--out", str(tmp_path / "head"), "--max-steps", "4", "--val-every", "2",
                               "--batch-size", "4", "--max-len", "32", "--depth", "2", "--num-validation", "4",
                               "--warmup-steps", "1"])
    finally:
        del SOURCES["test-eagle3"]
    return summary, tmp_path


def test_the_command_trains_and_saves_a_directory_the_eagle_drafter_loads(command_head):
    """A step-0 point, then one per --val-every, the best head saved as a speculators directory with its curve."""
    import json

    from specdec.training.eagle3 import budget_lr_factor

    summary, tmp_path = command_head
    assert summary["steps"] == 4 and summary["val_sequences"] == 4 and summary["train_sequences"] == 16
    curve = json.loads((tmp_path / "head" / "curve.json").read_text())["curve"]
    assert [p["step"] for p in curve] == [0, 2, 4]
    head = load_speculators(tmp_path / "head")
    assert head.config.aux_layers == (0, 1) and head.draft_vocab.numel() == 40
    build("eagle", target=specdec.load_target("tiny-llama"), head=tmp_path / "head")
    assert budget_lr_factor(0, 0.0, 10.0, 2, 0.1) == 0.5 and budget_lr_factor(5, 5.0, 10.0, 2, 0.1) == pytest.approx(0.55)


@pytest.mark.slow
def test_the_speculators_export_round_trips(command_head):
    """The trained head exported in fp32 and bf16 (export_speculators): the fp32 export has the trained
    head's tensors, steps and MAL; every output of every directory equals the plain loop's; the package
    (when installed) parses both exports."""
    from safetensors.torch import load_file

    from specdec.core.metrics import GenerationStats
    from specdec.drafters.speculators_format import export_speculators, package_check

    _, tmp_path = command_head
    target = specdec.load_target("tiny-llama")
    dirs = {"trained": tmp_path / "head"}
    for dtype in (torch.float32, torch.bfloat16):
        report = export_speculators(tmp_path / "head", target, tmp_path / str(dtype), dtype=dtype)
        assert report["draft_vocab"] == 40 and report["aux_layers"] == [0, 1]
        dirs[str(dtype)] = tmp_path / str(dtype)
    x, y = (load_file(str(dirs[k] / "model.safetensors")) for k in ("trained", "torch.float32"))
    assert x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
    prompts = [f"tell me about kw{i} zq{i * 3}" for i in range(2)]
    plain = [specdec.generate(target, None, p, max_new_tokens=12).token_ids for p in prompts]
    mal, steps = {}, {}
    for label, directory in dirs.items():
        drafter = build("eagle", target=target, head=directory, head_dtype=torch.float32)
        outs = [specdec.generate(target, drafter, p, shape="chain(3)", max_new_tokens=12) for p in prompts]
        assert [o.token_ids for o in outs] == plain, label
        mal[label] = GenerationStats.merge([o.stats for o in outs]).mean_acceptance_length
        steps[label] = [[s.accepted for s in o.stats.steps] for o in outs]
    assert mal["trained"] == mal["torch.float32"] and steps["trained"] == steps["torch.float32"]
    pytest.importorskip("speculators.models.eagle3", reason="the speculators package is not installed")
    for label in ("torch.float32", "torch.bfloat16"):
        assert package_check(dirs[label])["package_class"] == "Eagle3DraftModel"
