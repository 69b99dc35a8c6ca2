"""The static-shape fast path (`specdec.runtime.graphs`, `cache="graphs"`): a bucketed, padded forward over
a preallocated cache equals `Target.forward`, keeps the cache equal to a prefill, is exact for every
drafter, shape and family, reuses its captured buckets across generations, and rejects bad sizes
before generating. On a CPU the buckets run eagerly (the function a CUDA graph would capture); the
CUDA test at the end runs only where torch sees a GPU."""

import gc
import types
import weakref

import pytest
import torch

import specdec
from specdec.runtime import graphs
from specdec.runtime.cache import KVCache
from specdec.drafters import build, build_for_tests
from specdec.runtime.forwards import resolve_cache
from specdec.runtime.graphs import StaticForward, static_forward
from specdec.measure.latency import CurveTimer, cached_latency, measure_latency
from specdec.loop.reference import reference_generate
from specdec.runtime.static_cache import StaticKVCache

PROMPT = [3, 5, 7, 3, 5, 7, 3, 5, 9, 3, 5]


def _random_parents(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)])


def _max_gap(target, tokens, parents, runner, cache, past_tokens) -> float:
    """Largest |difference| of logits, hidden states and cache entries between the runner's forward
    and `Target.forward` on a fresh cache holding the same past."""
    ref = KVCache()
    target.prefill(past_tokens, ref)
    want = target.forward(tokens, ref, parents)
    got = runner.forward(tokens, cache, parents)
    gaps = [(got.logits - want.logits).abs().max(), (got.hidden - want.hidden).abs().max()]
    for (k1, v1), (k2, v2) in zip(cache.tensors(), ref.tensors(), strict=True):
        gaps += [(k1 - k2).abs().max(), (v1 - v2).abs().max()]
    return float(max(gaps))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9])
def test_padded_bucket_forward_equals_target_forward(tiny_llama64, n):
    gen = torch.Generator().manual_seed(n)
    runner = StaticForward(tiny_llama64, 64, buckets=(1, 2, 4, 8, 16))
    cache = runner.open()
    tiny_llama64.prefill(PROMPT, cache)
    tokens = torch.randint(0, 64, (1, n), generator=gen)
    assert _max_gap(tiny_llama64, tokens, _random_parents(n, gen), runner, cache, PROMPT) < 1e-12
    assert cache.length == len(PROMPT) + n


def test_a_block_with_cached_nodes_equals_target_forward(tiny_llama64):
    """parents longer than the new tokens: the block's first nodes are already cached (how a model
    drafter scores the next level of its tree)."""
    runner = StaticForward(tiny_llama64, 64, buckets=(4,))
    cache = runner.open()
    tiny_llama64.prefill(PROMPT, cache)
    runner.forward(torch.tensor([[9, 10]]), cache, torch.tensor([-1, -1]))  # two cached block nodes
    ref = KVCache()
    tiny_llama64.prefill(PROMPT, ref)
    tiny_llama64.forward(torch.tensor([[9, 10]]), ref, torch.tensor([-1, -1]))
    parents = torch.tensor([-1, -1, 1, 0, 2])  # new: a child of node 1, a child of node 0, a grandchild
    got = runner.forward(torch.tensor([[11, 12, 13]]), cache, parents)
    want = tiny_llama64.forward(torch.tensor([[11, 12, 13]]), ref, parents)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.hidden, want.hidden)


def test_the_equality_check_catches_pad_rows_leaking_into_real_ones(tiny_llama64, monkeypatch):
    """Mutation check: if real rows could see the pad rows' entries, the comparison above fails."""
    fill = StaticForward._fill

    def leaky(self, b, tokens, parents, past, *rest):
        fill(self, b, tokens, parents, past, *rest)
        b.mask[0, 0, : tokens.shape[1], past + tokens.shape[1]: past + b.ids.shape[1]] = 0

    monkeypatch.setattr(StaticForward, "_fill", leaky)
    runner = StaticForward(tiny_llama64, 64, buckets=(8,))
    cache = runner.open()
    tiny_llama64.prefill(PROMPT, cache)
    tokens = torch.tensor([[4, 8, 15]])
    assert _max_gap(tiny_llama64, tokens, torch.tensor([-1, 0, 1]), runner, cache, PROMPT) > 1e-6


@pytest.mark.parametrize("shape", ["chain(4)", "tree(3,2)", "dynamic(top_k=3,depth=4,budget=9)", "auto"])
@pytest.mark.parametrize("name", ["none", "eagle", "ngram", "small"])
def test_graphs_greedy_equals_plain_greedy_for_every_family(tiny64, name, shape):
    want = reference_generate(tiny64, PROMPT, max_new_tokens=14, stop_on_eos=False)
    drafter = build_for_tests(name, target=tiny64)
    out = specdec.generate(tiny64, drafter, PROMPT, shape=shape, max_new_tokens=14, stop_on_eos=False,
                           cache="graphs", buckets=(1, 2, 4, 8, 16, 64))
    assert out.token_ids == want


@pytest.mark.parametrize("name", ["none", "eagle", "ngram"])
def test_graphs_sampling_draws_what_the_dynamic_cache_draws(tiny_llama64, name):
    """Same seed, same law: at T > 0 the fast path's forwards give the same distributions, so the
    same generator draws the same tokens (fp64: no rounding flips a draw)."""
    outs = {}
    for cache in ("dynamic", "graphs"):
        drafter = build_for_tests(name, target=tiny_llama64)
        outs[cache] = specdec.generate(tiny_llama64, drafter, PROMPT, shape="tree(2,2)", max_new_tokens=16,
                                       temperature=0.9, top_k=20, seed=5, stop_on_eos=False, cache=cache).token_ids
    assert outs["graphs"] == outs["dynamic"]


def test_compiled_greedy_equals_the_eager_plain_loop_and_compiles_once(tiny_llama64, capfd, tmp_path, monkeypatch):
    """Plain decoding (width 1, padded to 8), then verifying chains of 4, then EAGLE (aux layers) on a long prompt
    (another capacity) with other buckets, and a latency curve after two contexts (two more caches): one program
    (width 2+) serves all."""
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for name, prompt, buckets in (("none", PROMPT, (8,)), ("ngram", PROMPT, (8,)), ("eagle", PROMPT * 30, (2, 8))):
        out = specdec.generate(tiny_llama64, build_for_tests(name, target=tiny_llama64), prompt, shape="chain(4)",
                               max_new_tokens=14, stop_on_eos=False, cache="compiled", buckets=buckets)
        assert out.token_ids == reference_generate(tiny_llama64, prompt, max_new_tokens=14, stop_on_eos=False)
        assert capfd.readouterr().err.count("specdec: compiling") == (name == "none")  # said once, then kept
    assert graphs._FORWARDS[tiny_llama64.model]["verifier"].capacity == 512
    timer = CurveTimer(tiny_llama64, widths=(2, 5), contexts=(16, 300), cache="compiled")
    specdec.generate(tiny_llama64, None, PROMPT, max_new_tokens=3, cache="compiled", buckets=(8,))
    assert [kv.length for _, kv, _ in timer._caches] == [16, 300]  # the curve's own caches: kept apart from the loop's
    assert timer.padded and not CurveTimer(tiny_llama64, widths=(2, 5), cache="dynamic").padded  # buckets: priced so
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before + 1
    packed = specdec.tiny_target("llama", dtype=torch.float32)
    if specdec.runtime.kernels.apply_kernel(packed.model, "onednn"):  # inductor packs weights itself, or not at all
        with pytest.raises(ValueError, match="runs the 'onednn' kernel: load it with kernel='torch'"):
            StaticForward(packed, 64, (8,), capture="compile")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    specdec.machine.update_record(tiny_llama64.label, "cpu", tiny_llama64.dtype, cache={"cache": "compiled"})
    assert resolve_cache("auto", tiny_llama64) == "compiled"  # what tune found faster


def test_each_model_keeps_its_compiled_programs_on_a_code_object_of_its_own(tiny_llama64):
    """A forward checks only its own model's programs' guards, never another model's first."""
    other = specdec.tiny_target("llama", dtype=torch.float32, seed=3)
    for target in (tiny_llama64, other):
        specdec.generate(target, None, PROMPT, max_new_tokens=3, cache="compiled", buckets=(8,))
    codes = [graphs._CODES[t.model][hash(graphs.weights_signature(t))] for t in (tiny_llama64, other)]
    assert codes[0] is not codes[1] and codes[0] == graphs.StaticForward._forward.__code__  # equal code, two objects
    for code, target in zip(codes, (tiny_llama64, other)):
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
        assert 1 <= len(entries) <= 2  # the width-1 and width-2+ programs of this model, none of the other's
    assert not torch._C._dynamo.eval_frame._debug_get_cache_entry_list(graphs.StaticForward._forward.__code__)


class _Doubled(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.inner(x)


def test_a_module_wrapped_after_a_compile_runs_in_a_program_of_its_own():
    """Compiled programs skip guards on the model's modules: a module wrapped around the same weights changes the
    weights signature, so the next forward runs a program traced on the new modules (the stale one would not double)."""
    target = specdec.tiny_target("llama", dtype=torch.float32, seed=4)
    tokens = torch.tensor([PROMPT])

    def compiled():
        forward = graphs.static_forward(target, 64, (16,), capture="compile")
        return forward.forward(tokens, forward.open()).logits

    before = compiled()
    torch.testing.assert_close(before, target.forward(tokens, KVCache()).logits)
    mlp = target.model.model.layers[-1].mlp
    mlp.down_proj = _Doubled(mlp.down_proj)
    after = compiled()
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, target.forward(tokens, KVCache()).logits)


def test_auto_cache_is_graphs_on_cuda_only(tiny_llama64):
    assert resolve_cache("auto", tiny_llama64) == "dynamic"
    assert resolve_cache("auto", types.SimpleNamespace(device=torch.device("cuda"))) == "graphs"
    assert resolve_cache("static", tiny_llama64) == "static"
    with pytest.raises(ValueError, match="unknown cache 'paged'; expected auto or one of dynamic, static, graphs, compiled"):
        resolve_cache("paged", tiny_llama64)


def test_bad_buckets_and_sizes_fail_before_generating(tiny_llama64):
    drafter = specdec.drafters.build("none", target=tiny_llama64)  # sized by the shape, unlike drafter=None

    def run(**options):
        return specdec.generate(tiny_llama64, drafter, PROMPT, max_new_tokens=8, **options)

    with pytest.raises(ValueError, match=r"width buckets \(1, 2, 4\) do not cover the widest verification: "
                                         r"9 tokens \(the root \+ 8 draft nodes\); add a bucket >= 9"):
        run(shape="chain(8)", cache="graphs", buckets=(1, 2, 4))
    with pytest.raises(ValueError, match="width buckets must be distinct ascending integers >= 1, got \\(4, 2\\)"):
        run(cache="graphs", buckets=(4, 2))
    with pytest.raises(ValueError, match="width buckets must be distinct ascending"):
        run(cache="graphs", buckets=())
    with pytest.raises(ValueError, match=r"buckets=\(1, 8\) apply to cache='graphs' or 'compiled' only, got 'dynamic'"):
        run(cache="dynamic", buckets=(1, 8))
    with pytest.raises(ValueError, match=r"cache_capacity=24 is too short: .* draft nodes \(7, padded to bucket 8\) = 26"):
        run(shape="chain(4)", cache="graphs", cache_capacity=24)
    with pytest.raises(ValueError, match="capture='cuda_graph' needs a CUDA target"):
        StaticForward(tiny_llama64, 64, capture="cuda_graph")
    with pytest.raises(ValueError, match="unknown capture 'jit'"):
        StaticForward(tiny_llama64, 64, capture="jit")
    runner = StaticForward(tiny_llama64, 64, buckets=(1, 2))
    with pytest.raises(ValueError, match="runs on its own cache only"):
        runner.forward(torch.tensor([[1]]), StaticKVCache(64))
    with pytest.raises(ValueError, match=r"a forward of 3 tokens exceeds the widest bucket 2 \(buckets \(1, 2\)\)"):
        runner.bucket(3)


def test_default_buckets_widen_to_a_large_draft(tiny_llama64):
    out = specdec.generate(tiny_llama64, build_for_tests("eagle", target=tiny_llama64), PROMPT,
                           shape="dynamic(top_k=8,depth=3,budget=130)", max_new_tokens=4, stop_on_eos=False,
                           cache="graphs")
    assert out.token_ids == reference_generate(tiny_llama64, PROMPT, max_new_tokens=4, stop_on_eos=False)
    assert graphs._FORWARDS[tiny_llama64.model]["verifier"].buckets[-1] == 256


def test_the_static_forward_is_kept_and_replaced_when_it_cannot_serve():
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=1)
    specdec.generate(target, None, PROMPT, max_new_tokens=6, cache="graphs")
    first = graphs._FORWARDS[target.model]["verifier"]
    assert first.capacity % 256 == 0 and set(first._bucket) == {1}
    specdec.generate(target, None, PROMPT[:5], max_new_tokens=9, cache="graphs")
    assert graphs._FORWARDS[target.model]["verifier"] is first  # captured buckets survive between generations
    specdec.generate(target, None, PROMPT, max_new_tokens=6, cache="graphs", buckets=(1, 8))
    assert graphs._FORWARDS[target.model]["verifier"] is not first  # other buckets
    second = graphs._FORWARDS[target.model]["verifier"]
    with torch.no_grad():
        target.model.lm_head.weight = torch.nn.Parameter(target.model.lm_head.weight.clone())
    target = specdec.runtime.model.Target(target.model, target.tokenizer, name=target.name)  # the lm_head is read at init
    assert static_forward(target, 64, (1, 8)) is not second  # weights at other addresses: a graph would read stale ones
    assert static_forward(target, 300, (1, 8)).capacity == 512  # more capacity: rounded up to 256s


def test_a_target_that_starts_capturing_layers_gets_a_new_static_forward():
    """A graph captured before `capture_layers` returns no hidden states: a drafter that asks for
    them (EAGLE-3 fusion) must get a new static forward, not the old graphs."""
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=0, logit_scale=4.0)
    specdec.generate(target, None, PROMPT, max_new_tokens=4, cache="graphs")
    plain = graphs._FORWARDS[target.model]["verifier"]
    assert plain.aux_layers == ()
    target.capture_layers((0, 1))
    out = static_forward(target, 64).forward(torch.tensor([[3]]), static_forward(target, 64).open())
    assert graphs._FORWARDS[target.model]["verifier"] is not plain
    assert out.aux is not None and out.aux.shape[-1] == 2 * target.hidden_size


def test_a_dropped_target_frees_its_static_forward():
    """The kept forwards are keyed weakly by model and hold their target weakly: no cache or graph
    outlives the model it was made for."""
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=2)
    specdec.generate(target, None, PROMPT, max_new_tokens=3, cache="graphs")
    kept = weakref.ref(graphs._FORWARDS[target.model]["verifier"])
    model = weakref.ref(target.model)
    del target
    gc.collect()
    # This target's own forward and model are gone (other tests' objects may be collected too, so
    # the number of kept forwards says nothing).
    assert kept() is None and model() is None


def test_latency_through_the_fast_path_is_measured_and_cached_apart(tiny_llama64, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    curve = measure_latency(tiny_llama64, widths=(1, 3, 5), contexts=(16,), repeats=1, cache="graphs")
    assert curve.widths == (1, 3, 5) and all(t > 0 for t in curve.seconds[0])
    cached_latency(tiny_llama64, widths=(1, 2), contexts=(8,), repeats=1, cache="graphs")
    cached_latency(tiny_llama64, widths=(1, 2), contexts=(8,), repeats=1)
    from specdec import machine

    curves = machine.load_record(tiny_llama64.label, tiny_llama64.device, tiny_llama64.dtype)["curves"]
    assert len(curves) == 2 and sum(name.startswith("graphs_") for name in curves) == 1


@pytest.mark.slow
def test_embedded_target_graphs_greedy_equals_plain_loop(embedded):
    """The issue's identity, on the CPU: the fast path's greedy output equals the plain loop's in fp32."""
    prompt = "Name three uses of a paperclip."
    want = specdec.generate(embedded, None, prompt, max_new_tokens=20, stop_on_eos=False, cache="dynamic").token_ids
    for shape in ("chain(1)", "chain(4)", "tree(4,2,1,1)"):
        drafter = build("eagle", target=embedded) if shape != "chain(1)" else None
        out = specdec.generate(embedded, drafter, prompt, shape=shape, max_new_tokens=20, stop_on_eos=False,
                               cache="graphs")
        assert out.token_ids == want, shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (captures CUDA graphs)")
@pytest.mark.parametrize("name", ["none", "eagle", "ngram", "small", "lowbit"])
@pytest.mark.parametrize("shape", ["chain(4)", "dynamic(top_k=4,depth=4,budget=12)", "auto"])
def test_cuda_graphs_greedy_equals_the_plain_loop_on_cuda(name, shape):
    target = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float32, seed=0, logit_scale=4.0, device="cuda")
    want = specdec.generate(target, None, PROMPT, max_new_tokens=16, stop_on_eos=False, cache="dynamic").token_ids
    out = specdec.generate(target, build_for_tests(name, target=target), PROMPT, shape=shape, max_new_tokens=16,
                           stop_on_eos=False)  # cache="auto" = graphs on CUDA
    assert out.token_ids == want
    assert graphs._FORWARDS[target.model]["verifier"].capture == "cuda_graph"


def test_a_small_draft_model_on_the_fast_path_is_exact_past_its_widest_bucket(tiny_llama64):
    """A `ModelDrafter` (a second model) on `graphs`: its prompt feed (150 tokens) is wider than any
    bucket and runs eagerly into the same preallocated cache; its tree levels run bucketed."""
    draft_model = specdec.tiny_target("llama", vocab_size=64, dtype=torch.float64, seed=3, logit_scale=4.0)
    prompt = (PROMPT * 14)[:150]
    want = reference_generate(tiny_llama64, prompt, max_new_tokens=10, stop_on_eos=False)
    drafter = build("small", target=tiny_llama64, model=draft_model, cache="graphs")
    out = specdec.generate(tiny_llama64, drafter, prompt, shape="tree(3,2)", max_new_tokens=10, stop_on_eos=False,
                           cache="graphs")
    assert out.token_ids == want
    assert type(drafter.cache).__name__ == "StaticKVCache"
    runner = graphs._FORWARDS[draft_model.model]["drafter"]
    assert set(runner._bucket) <= {1, 2, 4, 8} and runner._bucket  # levels ran bucketed, the feed eagerly


def test_drafter_caches_fail_clearly(tiny_llama64):
    with pytest.raises(ValueError, match="cache='graphs' preallocates the draft cache, which never evicts"):
        build("self_draft", target=tiny_llama64, kv="window(sink=2,recent=4)", cache="graphs")
    with pytest.raises(ValueError, match="unknown cache 'paged'"):
        build("lowbit", target=tiny_llama64, quant="rtn8_pc", cache="paged")
    auto = build("self_draft", target=tiny_llama64, kv="window(sink=2,recent=4)")  # auto: a growing cache
    assert type(auto.cache).__name__ == "KVCache"
