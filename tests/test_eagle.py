"""The EAGLE drafter: valid trees in every shape, greedy identity, sampling exactness, the head's
cache after rollback, save/load, bad inputs, and training prompts disjoint from the evaluation suite.

Tiny fp64 models use an untrained (random) head; the embedded target uses the shipped head.
"""

import json
import re
from pathlib import Path

import pytest
import torch

import specdec
from specdec.core import tree as tree_ops
from specdec.runtime.cache import KVCache
from specdec.drafters import DraftRequest, build
from specdec.drafters.eagle import HEADS_DIR, random_head
from specdec.drafters.eagle_head import EagleHead, widen
from specdec.training.prompts import template_prompts
from specdec.loop.decode import prefill
from specdec.loop.reference import next_token_logits, reference_generate
from specdec.core.sampling import SamplingConfig, target_probs_from_logits
from specdec.core.shapes import parse_shape

SHAPES = ["chain(1)", "chain(4)", "tree(1,1,1)", "tree(3,2,1)", "dynamic(top_k=1,depth=1,budget=1)",
          "dynamic(top_k=4,depth=5,budget=12)"]
PROMPT = [1, 5, 9, 13, 2, 7, 11, 3]
EVAL_PROMPTS = Path(__file__).resolve().parents[1] / "experiments" / "prompts" / "default.jsonl"


@pytest.fixture(scope="module")
def tiny():
    return specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, seed=0, logit_scale=4.0)


def request_for(target, drafter, token_ids, shape, max_depth=16, sampling=SamplingConfig()):
    """Start `drafter` afresh at `token_ids` (reset + the prefill Step) and ask for a draft."""
    drafter.reset()
    drafter.commit(prefill(target, KVCache(), token_ids))
    return DraftRequest(token_ids=torch.tensor([token_ids]), shape=parse_shape(shape), sampling=sampling,
                        generator=torch.Generator().manual_seed(0), max_depth=max_depth)


def _draft(drafter, target, shape):
    return drafter.propose(request_for(target, drafter, PROMPT, shape))


def tree_depth(shape) -> int:
    shape = parse_shape(shape)
    return {"ChainShape": lambda s: s.k, "TreeShape": lambda s: len(s.widths),
            "DynamicShape": lambda s: s.depth}[type(shape).__name__](shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("max_depth", [16, 2])
def test_every_shape_gives_a_valid_tree(tiny, shape, max_depth):
    drafter = build("eagle", target=tiny, head="random", draft_vocab=20)
    draft = drafter.propose(request_for(tiny, drafter, PROMPT, shape, max_depth=max_depth))
    parents = tree_ops.as_parents(draft.parents)  # raises unless parents precede children
    assert 1 <= draft.num_nodes <= parse_shape(shape).max_nodes
    assert int(tree_ops.depths(parents).max()) <= min(tree_depth(shape), max_depth)
    allowed = set(drafter.vocab.tolist())
    assert set(draft.tokens[0].tolist()) <= allowed, "a drafted token lies outside the draft vocabulary"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("options", [{}, {"draft_vocab": 24, "refresh": False}, {"head_dtype": "bfloat16"},
                                     {"draft_vocab": 24, "head_dtype": torch.float32}])
def test_greedy_output_equals_reference(tiny, shape, options):
    ref = reference_generate(tiny, PROMPT, max_new_tokens=16, stop_on_eos=False)
    drafter = build("eagle", target=tiny, head="random", **options)
    out = specdec.generate(tiny, drafter, PROMPT, shape=shape, max_new_tokens=16, stop_on_eos=False)
    assert out.token_ids == ref


def test_head_cache_after_rollback_equals_a_fresh_prefill(tiny):
    """After several draft/verify/rollback steps (refresh mode) the head's cache and its predicted
    root feature equal those of a fresh drafter run on the committed tokens at once."""
    head = random_head(tiny)
    used = build("eagle", target=tiny, head=head)
    out = specdec.generate(tiny, used, PROMPT, shape="tree(2,2)", max_new_tokens=12, stop_on_eos=False)
    committed = PROMPT + out.token_ids  # the loop's last commit already told `used` about all of them
    used.propose(DraftRequest(token_ids=torch.tensor([committed]), shape=parse_shape("chain(1)"),
                              sampling=SamplingConfig(), generator=torch.Generator(), max_depth=16))
    fresh = build("eagle", target=tiny, head=head)
    fresh.propose(request_for(tiny, fresh, committed, "chain(1)"))
    assert used.cache.length == fresh.cache.length == len(committed) - 1
    for (k1, v1), (k2, v2) in zip(used.cache.tensors(), fresh.cache.tensors()):
        torch.testing.assert_close(k1, k2)
        torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(used.root_feature, fresh.root_feature)


# T > 0: Pearson chi-square goodness of fit of the first LENGTH = 2 generated tokens (over a 5-token
# vocabulary: 25 cells, those with expected count < 5 pooled into one) against the exact joint target
# distribution, from N_SAMPLES = 1200 generations with seeds 0..1199 under a point-mass tree draft;
# passes when p >= ALPHA = 1e-3. Seeds are fixed, so the outcome is deterministic. (The generic,
# larger version for every drafter lives in tests/test_exactness.py.)
N_SAMPLES, LENGTH, ALPHA = 1200, 2, 1e-3


def exact_joint_probs(target, prompt_ids: list[int], length: int,
                      sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(first `length` new tokens = t) for every t in V^length with nonzero probability."""
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, p in frontier.items():
            probs = target_probs_from_logits(next_token_logits(target, [*prompt_ids, *prefix]).double(), sampling)
            for tok in torch.nonzero(probs).flatten().tolist():
                nxt[(*prefix, tok)] = p * float(probs[tok])
        frontier = nxt
    return frontier


def test_sampling_over_a_tree_matches_the_target_distribution():
    from collections import Counter

    from scipy.stats import chisquare

    target = specdec.tiny_target("llama", vocab_size=5, hidden_size=16, dtype=torch.float64, seed=0, logit_scale=6.0)
    drafter = build("eagle", target=target, head="random")
    prompt, sampling = [1, 2, 3], SamplingConfig(temperature=1.0)
    counts = Counter(
        tuple(specdec.generate(target, drafter, prompt, shape="tree(2,2)", max_new_tokens=LENGTH, temperature=1.0,
                               seed=seed, stop_on_eos=False).token_ids)
        for seed in range(N_SAMPLES)
    )
    exact = exact_joint_probs(target, prompt, LENGTH, sampling)
    assert set(counts) <= set(exact), "sampled a sequence the target gives zero probability"
    big = [c for c in exact if exact[c] * N_SAMPLES >= 5]
    small = [c for c in exact if exact[c] * N_SAMPLES < 5]
    observed = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    expected = [exact[c] * N_SAMPLES for c in big] + ([sum(exact[c] for c in small) * N_SAMPLES] if small else [])
    p = float(chisquare(observed, expected).pvalue)
    assert p >= ALPHA, f"EAGLE tree(2,2): chi-square p = {p:.2e} < {ALPHA}"


def test_save_load_round_trip_gives_identical_drafts(tiny, tmp_path):
    head = random_head(tiny)
    path = head.save(tmp_path / "head", dtype=torch.float32)
    loaded = EagleHead.load(path)
    assert json.loads(path.with_suffix(".json").read_text())["vocab_size"] == tiny.vocab_size
    for shape in ("chain(4)", "dynamic(top_k=3,depth=4,budget=10)"):
        a = _draft(build("eagle", target=tiny, head=head, draft_vocab=30), tiny, shape)
        b = _draft(build("eagle", target=tiny, head=str(path), draft_vocab=30), tiny, shape)
        c = _draft(build("eagle", target=tiny, head=loaded, draft_vocab=30), tiny, shape)
        for other in (b, c):
            assert torch.equal(a.tokens, other.tokens) and torch.equal(a.parents, other.parents)


def test_bad_inputs_name_what_mismatched(tiny):
    other_vocab = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary 64 \\(target has 80\\)"):
        build("eagle", target=other_vocab, head=random_head(tiny))
    other_width = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, hidden_size=48)
    with pytest.raises(ValueError, match="hidden size 32 \\(target has 48\\)"):
        build("eagle", target=other_width, head=random_head(tiny))
    with pytest.raises(ValueError, match="draft_vocab=65 > the vocabulary of 'tiny-llama' \\(64\\)"):
        build("eagle", target=tiny, head="random", draft_vocab=65)
    with pytest.raises(ValueError, match="draft_vocab must be an integer >= 1"):
        build("eagle", target=tiny, head="random", draft_vocab=0)
    with pytest.raises(FileNotFoundError, match="no EAGLE head ships for target 'tiny-llama'"):
        build("eagle", target=tiny)
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        build("eagle", target=tiny, head="random", head_dtype="bf16")
    for bad, what in [("dynamic(top_k=4,depth=4,budget=0)", "budget"), ("dynamic(top_k=4,depth=0,budget=8)", "depth"),
                      ("dynamic(top_k=0,depth=4,budget=8)", "top_k"), ("tree(2,0)", "width"), ("chain(0)", "k >= 1")]:
        with pytest.raises(ValueError, match=what):
            parse_shape(bad)


def test_shipped_head_is_found_and_exact_on_the_embedded_target(embedded):
    assert (HEADS_DIR / "smollm2-135m.safetensors").stat().st_size < 12e6
    drafter = build("eagle", target=embedded)  # finds the shipped head by target name
    prompt = embedded.encode_prompt("Name three colours of the rainbow.")
    ref = reference_generate(embedded, prompt, max_new_tokens=24)
    out = specdec.generate(embedded, drafter, prompt, shape="dynamic(top_k=6,depth=5,budget=24)", max_new_tokens=24)
    assert out.token_ids == ref
    assert out.stats.mean_acceptance_length > 1.5, "the shipped head barely helps: is it trained?"


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_training_prompts_share_no_long_ngram_with_the_evaluation_suite():
    """Reads the evaluation suite (it must exist: the check is not skipped) and every training prompt
    the shipped head was trained on (runs over template_prompts(1280, seed=0); see heads/README.md)."""
    rows = [json.loads(line) for line in EVAL_PROMPTS.read_text().splitlines() if line.strip()]
    assert rows, f"{EVAL_PROMPTS} holds no prompts"
    evaluation = set().union(*(_ngrams(turn, 8) for row in rows for turn in row["turns"]))
    shared = [p for p in template_prompts(1280, seed=0) if _ngrams(p, 8) & evaluation]
    assert not shared, f"training prompts share an 8-word run with the evaluation suite: {shared[:3]}"


def test_a_quantized_target_finds_its_models_shipped_head():
    from types import SimpleNamespace

    from specdec.drafters.eagle import shipped_head_path

    plain = shipped_head_path(SimpleNamespace(name="smollm2-135m", quant="none"))
    assert shipped_head_path(SimpleNamespace(name="smollm2-135m", quant="rtn4_g64")) == plain


def fused_head(target, layers=(1,), seed=0):
    """A random head fusing `layers` (EAGLE-3), its fc_aux nonzero so the aux features matter."""
    head = widen(random_head(target, seed), layers)
    with torch.no_grad():
        head.fc_aux.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return head


@pytest.mark.parametrize("shape", ["chain(4)", "tree(3,2,1)", "dynamic(top_k=4,depth=5,budget=12)"])
@pytest.mark.parametrize("refresh", [True, False])
def test_a_head_fusing_aux_layers_is_exact_and_reads_them(shape, refresh):
    """Greedy identity with a head that fuses target layer 1; its drafts depend on that layer (they
    differ from the same head's without it), and a widened head (fc_aux = 0) drafts what it did before."""
    tiny = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, seed=0, logit_scale=4.0)
    ref = reference_generate(tiny, PROMPT, max_new_tokens=16, stop_on_eos=False)
    drafter = build("eagle", target=tiny, head=fused_head(tiny), refresh=refresh)
    assert tiny.aux_layers == (1,)
    out = specdec.generate(tiny, drafter, PROMPT, shape=shape, max_new_tokens=16, stop_on_eos=False)
    assert out.token_ids == ref
    fused = _draft(drafter, tiny, shape).tokens
    plain_head = random_head(tiny)
    plain = _draft(build("eagle", target=tiny, head=plain_head), tiny, shape).tokens
    widened = _draft(build("eagle", target=tiny, head=widen(plain_head, (1,))), tiny, shape).tokens
    assert torch.equal(widened, plain)
    assert not torch.equal(fused, plain), "the fused head's drafts do not depend on the aux layer"


def test_aux_layers_reach_the_drafter_as_the_targets_hidden_states():
    """Step.target_aux holds exactly the target's hidden states of its aux layers per kept row, and a
    target serving one aux set refuses another; a head's aux layers must exist in the target."""
    tiny = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, seed=0, logit_scale=4.0)
    tiny.capture_layers((1,))
    step = prefill(tiny, KVCache(), PROMPT)
    states = tiny.base(input_ids=torch.tensor([PROMPT[:-1]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(step.target_aux, states[1])
    torch.testing.assert_close(step.target_hidden, states[-1])
    with pytest.raises(ValueError, match=r"already captures hidden states \[1\]; a second drafter asked for \[0\]"):
        tiny.capture_layers((0,))
    other = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, seed=0, logit_scale=4.0)
    with pytest.raises(ValueError, match=r"aux_layers \[5\]"):
        build("eagle", target=other, head=widen(random_head(other), (5,)))


def test_a_fused_head_round_trips_through_its_files(tmp_path):
    tiny = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, seed=0, logit_scale=4.0)
    head = fused_head(tiny)
    loaded = EagleHead.load(head.save(tmp_path / "fused", dtype=torch.float64), dtype=torch.float64)
    assert loaded.config.aux_layers == (1,)
    a = _draft(build("eagle", target=tiny, head=head), tiny, "tree(3,2,1)")
    b = _draft(build("eagle", target=tiny, head=loaded), tiny, "tree(3,2,1)")
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    plain, features = random_head(tiny), torch.zeros(1, 2, 2 * tiny.hidden_size)
    with pytest.raises(ValueError, match=r"carry 1 aux layers; this head fuses 0 \(\[\]\)"):
        plain(features, torch.zeros(1, 2, tiny.hidden_size), torch.arange(2), None)


def test_the_heads_written_out_layer_computes_what_transformers_layer_does():
    """EagleHead runs its decoder layer's weights through its own wiring (`_attention`); through
    transformers' LlamaDecoderLayer the same weights give the same features, for a causal prefill
    and for a tree block after it (the cache then holds the same keys and values)."""
    from transformers import DynamicCache

    from specdec.runtime.model import tree_attention

    tiny = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, seed=0, logit_scale=4.0)
    head = fused_head(tiny).double().eval()
    hsize = tiny.hidden_size

    def through_transformers(features, embeds, positions, mask, cache):
        x = head.fc(torch.cat([embeds, features[..., :hsize]], -1))
        x = x + head.fc_aux(head.aux_norms[0](features[..., hsize:]))
        ids = positions[None]
        x = head.layer(x, attention_mask=mask[None, None], position_ids=ids, cache=cache, use_cache=True,
                       position_embeddings=head.rotary(x, ids))
        return head.norm(x)

    gen = torch.Generator().manual_seed(0)
    ours, theirs = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        for parents, n in ((None, 12), (torch.tensor([-1, 0, 0, 1, 2]), 5)):
            features = torch.randn(1, n, 2 * hsize, generator=gen, dtype=torch.float64)
            embeds = torch.randn(1, n, hsize, generator=gen, dtype=torch.float64)
            positions, mask = tree_attention(parents, n, ours.get_seq_length(), torch.float64)
            a = head(features, embeds, positions, mask, ours)
            b = through_transformers(features, embeds, positions, mask, theirs)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.layers[0].keys, theirs.layers[0].keys, rtol=1e-12, atol=1e-12)


def test_head_dtype_sets_what_the_drafts_run_in_and_leaves_the_target_alone(tiny):
    drafter = build("eagle", target=tiny, head="random", draft_vocab=24, head_dtype="bfloat16")
    assert drafter.head.fc.weight.dtype == drafter.vocab_weight.dtype == torch.bfloat16
    assert tiny.lm_head.weight.dtype == torch.float64
    full = build("eagle", target=tiny, head="random", draft_vocab=None, head_dtype="bfloat16")
    assert full.lm_weight.dtype == torch.bfloat16 and tiny.lm_head.weight.dtype == torch.float64
    draft = _draft(drafter, tiny, "tree(3,2,1)")
    assert draft.tokens.numel() == 3 + 6 + 6


def test_auto_head_dtype_follows_the_tuned_record(tmp_path, monkeypatch):
    """head_dtype='auto' (the default): the dtype `specdec.tune` stored for this head geometry, else the
    target's; building never measures. `measure_head_dtypes` (what tune runs) times both dtypes."""
    from specdec import machine, tune
    from specdec.drafters import eagle

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    fp32 = specdec.tiny_target("llama", dtype=torch.float32, vocab_size=64, seed=0)
    measured = tune.measure_head_dtypes(fp32, random_head(fp32), None, repeats=1, new_tokens=4)
    assert set(measured) == set(eagle.HEAD_DTYPES) and all(t > 0 for t in measured.values())
    monkeypatch.setattr(tune, "measure_head_dtypes", lambda *a, **k: pytest.fail("building measured"))
    assert build("eagle", target=fp32, head="random").head.fc.weight.dtype == torch.float32  # not tuned
    geometry = eagle.head_geometry(fp32, random_head(fp32), None)
    for stored, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        machine.update_record(fp32.label, fp32.device, fp32.dtype, head_dtype={geometry: {"dtype": stored}})
        assert build("eagle", target=fp32, head="random").head.fc.weight.dtype == dtype
    assert build("eagle", target=fp32, head="random", head_dtype=None).head.fc.weight.dtype == torch.float32
    fp64 = specdec.tiny_target("llama", dtype=torch.float64, vocab_size=64, seed=0)
    assert build("eagle", target=fp64, head="random").head.fc.weight.dtype == torch.float64


def test_building_a_drafter_leaves_the_callers_head_as_it_was():
    """A drafter copies the head it is given: building one in bfloat16 (as head_dtype='auto' measures)
    must not round the caller's float32 weights, nor move them."""
    tiny = specdec.tiny_target("llama", dtype=torch.float32, vocab_size=64, seed=0)
    head = random_head(tiny)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    build("eagle", target=tiny, head=head, head_dtype="bfloat16")
    build("eagle", target=tiny, head=head, head_dtype=torch.float32)
    after = head.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
