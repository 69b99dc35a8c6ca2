"""The speculators format (specdec/drafters/speculators_format.py): an EAGLE-3 head built by the
`speculators` package drafts here what the package's own forward computes; heads written here load
there and back unchanged; bad checkpoints are refused by name.

Tests that build or load a model in the package skip without it (`pip install specdec[speculators]`,
see scripts/install_speculators.sh: it must not replace the CPU torch)."""

import json

import pytest
import torch

import specdec
from specdec.loop.decode import prefill
from specdec.core.sampling import SamplingConfig
from specdec.core.shapes import parse_shape
from specdec.drafters import DraftRequest, build
from specdec.drafters.speculators_format import (Eagle3Config, Eagle3Head, export_speculators, load_speculators,
                                                 save_speculators)
from specdec.runtime.cache import KVCache

VOCAB, HIDDEN, LAYERS, AUX = 96, 32, 4, (1, 2, 3)
FLAGS = [{}, {"fc_norm": True, "norm_before_residual": True, "norm_output": True}, {"norm_before_fc": True}]


@pytest.fixture(scope="module")
def tiny():
    return specdec.tiny_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, dtype=torch.float32,
                               seed=0, logit_scale=4.0)


def layer_config(num_layers: int = 2, vocab: int = VOCAB, hidden: int = HIDDEN) -> dict:
    return dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def draft_ids(n: int = 40, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """n target ids (sorted, as speculators' t2d mask orders them), the draft columns."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n].sort().values


def perturb(module: torch.nn.Module, seed: int) -> None:
    """Every float parameter moved off its init (norms away from 1), so a miswired norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def random_eagle3(flags: dict, num_layers: int = 2, verifier: str = "tiny-llama") -> Eagle3Head:
    torch.manual_seed(1)
    config = Eagle3Config(layer_config=layer_config(num_layers), aux_layers=AUX, draft_vocab_size=40,
                          target_name=verifier, **flags)
    head = Eagle3Head(config, draft_vocab=draft_ids())
    perturb(head, 2)
    return head.eval()


def request_for(target, drafter, tokens, shape="chain(3)"):
    drafter.reset()
    drafter.commit(prefill(target, KVCache(), tokens))
    return DraftRequest(token_ids=torch.tensor([tokens]), shape=parse_shape(shape), sampling=SamplingConfig(),
                        generator=torch.Generator().manual_seed(0), max_depth=16)


def recorded_draft(target, drafter, tokens, shape="chain(3)"):
    """(draft tokens, the logits [N] of every scored node: the root first, then the nodes in order)."""
    seen = []
    inner = drafter._logits

    def record(features):
        out = inner(features)  # [B, n, N]
        seen.extend(out[0])
        return out

    drafter._logits = record
    try:
        draft = drafter.propose(request_for(target, drafter, tokens, shape))
    finally:
        del drafter._logits
    return draft.tokens[0].tolist(), seen


# ---- the package's own model -------------------------------------------------------------------
def package_model(target, flags: dict, num_layers: int = 2):
    """An Eagle3DraftModel built by the speculators package with random weights, its embedding the target's."""
    eagle3 = pytest.importorskip("speculators.models.eagle3", reason="the speculators package is not installed "
                                 "(pip install 'specdec[speculators]', see scripts/install_speculators.sh)")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**{k: v for k, v in layer_config(num_layers).items() if k != "model_type"})
    layer._attn_implementation = "sdpa"
    config = eagle3.Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=40, eagle_aux_hidden_state_layer_ids=list(AUX),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
        **flags)
    torch.manual_seed(3)
    model = eagle3.Eagle3DraftModel(config)
    ids = draft_ids()
    t2d = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
    model.load_vocab_mappings(t2d, ids - torch.arange(40))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.base.get_input_embeddings().weight)
        model.lm_head.weight.normal_(0, 0.5)
    perturb_except(model, ("embed_tokens", "verifier_"), 4)
    return model.eval()


def perturb_except(module, skip, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not name.startswith(skip) and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def package_steps(model, target, tokens: list[int], steps: int):
    """The package's forward over `tokens` (ttt_steps = steps, teacher-forced): logits [steps, L - 1, N]."""
    ids = torch.tensor([tokens])
    states = target.base(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.cat([states[k] for k in AUX], -1)[:, :-1]  # [1, L - 1, kH]: pair j = (features j, token j + 1)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: logits.append(out[0]))
    try:
        with torch.no_grad():
            drafted = model(hidden_states=aux, input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]),
                            ttt_steps=steps)
    finally:
        hook.remove()
    return torch.stack(logits), torch.stack([d[0] for d in drafted])  # [steps, L - 1, N], [steps, L - 1]


@pytest.mark.parametrize("flags", FLAGS, ids=["plain", "fcnorm-resnorm-outnorm", "norm-before-fc"])
def test_package_head_drafts_what_the_package_computes(tiny, tmp_path, flags):
    """Chain drafts of a package-built head, loaded here, against the package's teacher-forced forward
    over the prompt followed by those drafts: same tokens at every depth, logits within fp32 tolerance."""
    model = package_model(tiny, flags)
    model.save_pretrained(tmp_path / "head")
    drafter = build("eagle", target=tiny, head=tmp_path / "head", head_dtype=None)
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for length in (4, 9, 15):
        prompt = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        drafted, ours = recorded_draft(tiny, drafter, prompt, "chain(3)")
        logits, tokens = package_steps(model, tiny, prompt + drafted, steps=3)
        root = length - 2  # pair (features of the last prompt token's predecessor, last prompt token)
        for depth in range(3):
            theirs = logits[depth, root]
            worst = max(worst, float((ours[depth] - theirs).abs().max()))
            torch.testing.assert_close(ours[depth], theirs, rtol=1e-4, atol=1e-4)
            assert drafted[depth] == int(drafter.vocab[tokens[depth, root]])
    print(f"max |logit difference| {worst:.2e}")


def test_written_head_loads_in_the_package_and_back(tiny, tmp_path):
    """save_speculators -> the package's from_pretrained: same forward; -> load_speculators: same weights."""
    eagle3 = pytest.importorskip("speculators.models.eagle3", reason="the speculators package is not installed")
    tiny.model.save_pretrained(tmp_path / "verifier")  # the package reads the verifier's config and embedding
    head = random_eagle3(FLAGS[1], verifier=str(tmp_path / "verifier"))
    save_speculators(head, tmp_path / "out", dtype=torch.float32, embedding=tiny.base.get_input_embeddings().weight)
    loaded = eagle3.Eagle3DraftModel.from_pretrained(str(tmp_path / "out"))
    loaded.config.transformer_layer_config._attn_implementation = "sdpa"  # loading picks flex attention (CUDA)
    model = eagle3.Eagle3DraftModel(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    torch.testing.assert_close(model.embed_tokens.weight, tiny.base.get_input_embeddings().weight, rtol=0, atol=0)
    assert torch.equal(model.d2t + torch.arange(40), head.draft_vocab)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    logits, _ = package_steps(model, tiny, prompt, steps=2)
    drafter = build("eagle", target=tiny, head=head, head_dtype=None)
    _, ours = recorded_draft(tiny, drafter, prompt[:6], "chain(1)")
    torch.testing.assert_close(ours[0], logits[0, 4], rtol=1e-4, atol=1e-4)


def test_round_trip_is_exact(tiny, tmp_path):
    head = random_eagle3(FLAGS[1], num_layers=2)
    embedding = tiny.base.get_input_embeddings().weight
    again = load_speculators(save_speculators(head, tmp_path / "a", dtype=torch.float32, embedding=embedding))
    assert again.config == head.config and torch.equal(again.draft_vocab, head.draft_vocab)
    assert torch.equal(again.embed_tokens.weight, embedding)
    mine, theirs = head.state_dict(), again.state_dict()
    assert set(theirs) - set(mine) == {"embed_tokens.weight"}
    assert all(torch.equal(v, theirs[k]) for k, v in mine.items())
    prompt = [3, 17, 40, 8, 8, 61, 2]
    a = build("eagle", target=tiny, head=head, head_dtype=None)
    b = build("eagle", target=tiny, head=tmp_path / "a", head_dtype=None)
    assert recorded_draft(tiny, a, prompt, "tree(3,2,1)")[0] == recorded_draft(tiny, b, prompt, "tree(3,2,1)")[0]


def test_greedy_output_is_the_targets(tiny):
    """Exactness does not depend on the head: greedy speculative output = plain greedy output."""
    from specdec.loop.decode import generate

    drafter = build("eagle", target=tiny, head=random_eagle3(FLAGS[0]), head_dtype=None)
    prompt = [5, 9, 13, 2, 7]
    plain = generate(tiny, None, prompt, max_new_tokens=24, stop_on_eos=False).token_ids
    for shape in ("chain(4)", "dynamic(top_k=4,depth=4,budget=10)"):
        assert generate(tiny, drafter, prompt, shape=shape, max_new_tokens=24, stop_on_eos=False).token_ids == plain


@pytest.mark.parametrize("flags", FLAGS, ids=["plain", "fcnorm-resnorm-outnorm", "norm-before-fc"])
def test_an_eagle3_head_drafts_a_batch_as_each_row_alone(tiny, flags):
    """A speculators EAGLE-3 head batches: every row of `generate_batch` (prompts of different
    lengths, rows stopping at different lengths) drafts and outputs what it does alone."""
    from specdec.loop.decode import generate, generate_batch

    drafter = build("eagle", target=tiny, head=random_eagle3(flags), head_dtype=None)
    prompts, limits = [[5, 9, 13, 2, 7], [3, 1], [8, 8, 4, 2, 6, 1, 9, 9]], [16, 7, 12]
    for shape in ("chain(4)", "tree(2,2)", "dynamic(top_k=4,depth=4,budget=10)"):
        outs = generate_batch(tiny, drafter, prompts, shape=shape, max_new_tokens=limits, stop_on_eos=False)
        for prompt, limit, out in zip(prompts, limits, outs):
            alone = generate(tiny, drafter, prompt, shape=shape, max_new_tokens=limit, stop_on_eos=False)
            assert out.token_ids == alone.token_ids
            assert [s.accepted for s in out.stats.steps] == [s.accepted for s in alone.stats.steps]


# ---- bad checkpoints ---------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path, tiny):
    return save_speculators(random_eagle3(FLAGS[0]), tmp_path / "head", dtype=torch.float32,
                            embedding=tiny.base.get_input_embeddings().weight)


def edit_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def test_missing_or_unknown_model_type_is_refused(saved):
    edit_config(saved, speculators_model_type=None)
    with pytest.raises(ValueError, match="has no speculators_model_type"):
        load_speculators(saved)
    edit_config(saved, speculators_model_type="dflash")
    with pytest.raises(ValueError, match="'dflash' is not supported"):
        load_speculators(saved)


def test_head_for_another_target_is_refused(saved, tmp_path):
    other = specdec.tiny_target("llama", vocab_size=VOCAB, hidden_size=48, num_layers=LAYERS)
    with pytest.raises(ValueError, match=r"verifier 'tiny-llama' does not fit target 'tiny-llama': hidden size 32 "
                                         r"\(target has 48\)"):
        build("eagle", target=other, head=saved)
    shallow = specdec.tiny_target("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2)
    with pytest.raises(ValueError, match=r"aux_layers \[1, 2, 3\] \(hidden-state indices 0..1"):
        build("eagle", target=shallow, head=saved)


def test_vocabulary_map_that_does_not_fit_is_refused(saved, tiny):
    from safetensors.torch import load_file, save_file

    bigger = specdec.tiny_target("llama", vocab_size=VOCAB + 8, hidden_size=HIDDEN, num_layers=LAYERS)
    with pytest.raises(ValueError, match=rf"vocabulary {VOCAB} \(target has {VOCAB + 8}\)"):
        build("eagle", target=bigger, head=saved)
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"].clone()
    tensors["d2t"][-1] = VOCAB  # the last column now maps past the vocabulary
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(ValueError, match=r"d2t maps draft columns to target ids \[\d+\] outside"):
        load_speculators(saved)
    tensors["d2t"][-1] -= VOCAB - 1  # back inside, but now t2d disagrees
    save_file(tensors, str(saved / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d marks|same target token"):
        load_speculators(saved)


def test_draft_vocab_option_must_match_the_heads(saved, tiny):
    with pytest.raises(ValueError, match="draft_vocab must be None or 40, got 20"):
        build("eagle", target=tiny, head=saved, draft_vocab=20)


def test_specdec_heads_are_not_written_as_eagle3(tmp_path, tiny):
    from specdec.drafters.eagle import random_head

    with pytest.raises(TypeError, match="EagleHead is another architecture"):
        save_speculators(random_head(tiny), tmp_path / "x")
    with pytest.raises(ValueError, match=r"pass it as embedding \[96, 32\], got None"):
        save_speculators(random_eagle3(FLAGS[0]), tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---- export_speculators -------------------------------------------------------------------------------
def test_export_refuses_a_specdec_head_naming_why(tmp_path, tiny):
    from specdec.drafters.eagle import HEADS_DIR

    with pytest.raises(ValueError, match="another architecture than EAGLE-3"):
        export_speculators(HEADS_DIR / "smollm2-135m.safetensors", tiny, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_writes_a_directory_the_package_parses(tmp_path):
    pytest.importorskip("speculators.models.eagle3", reason="the speculators package is not installed")
    target = specdec.load_target("tiny-llama")
    config = Eagle3Config(layer_config=layer_config(vocab=target.vocab_size), aux_layers=(0, 1), draft_vocab_size=50,
                          target_name="tiny-llama")
    head = Eagle3Head(config, draft_vocab=draft_ids(50, target.vocab_size))
    save_speculators(head, tmp_path / "in", dtype=torch.float32, embedding=target.base.get_input_embeddings().weight)
    report = export_speculators(tmp_path / "in", target, tmp_path / "out", verifier="org/tiny-llama", check=True)
    assert report["package_class"] == "Eagle3DraftModel" and report["draft_vocab"] == 50
    assert json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"] == "org/tiny-llama"
    again = load_speculators(tmp_path / "out")
    assert torch.equal(again.lm_head.weight, head.lm_head.weight.to(torch.bfloat16).float())
