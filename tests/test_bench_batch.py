"""experiments.batch_sweep (scripts/bench_batch.py): its crossovers read the cells the way its docstring says, and `kv=POLICY@F`
sizes a policy to the context."""

from experiments import batch_sweep as bench_batch


def cell(drafter, batch, speedup, tok_s=1.0, context=256, shape="chain(4)"):
    return {"drafter": drafter, "shape": shape, "context": context, "batch": batch, "speedup": speedup, "tok_s": tok_s}


def test_speculation_stops_paying_at_the_first_batch_below_one():
    cells = [cell("ngram", 1, 1.4), cell("ngram", 4, 1.1), cell("ngram", 8, 0.7), cell("ngram", 16, 1.01),
             cell("eagle", 1, 1.8), cell("eagle", 8, 1.2), cell("small", 1, 0.8), cell("small", 8, 0.9)]
    stop = bench_batch.crossovers(cells)["speculation_stops_paying_at_batch"]
    assert stop == {"ngram chain(4) @256": 8, "eagle chain(4) @256": "pays at every batch",
                    "small chain(4) @256": "never pays"}


def test_lossy_kv_pays_where_it_beats_plain_and_the_full_cache():
    full, lossy = "self_draft[kv=full]", "self_draft[kv=window(sink=4,recent=100)]"
    cells = [cell(full, 8, 0.8, tok_s=8, context=2048), cell(lossy, 8, 1.1, tok_s=11, context=2048),
             cell(full, 1, 0.5, tok_s=5, context=2048), cell(lossy, 1, 0.6, tok_s=6, context=2048),
             cell(full, 1, 0.5, tok_s=5), cell(lossy, 1, 0.4, tok_s=4)]
    entry = bench_batch.crossovers(cells)["lossy_kv"][f"{lossy} chain(4)"]
    assert entry["beats_plain"] == [[2048, 8]] and entry["first_pays"] == [2048, 8]
    assert entry["beats_full_kv"] == [[2048, 1], [2048, 8]]


def test_a_kv_fraction_is_sized_to_the_context():
    assert bench_batch.sized("self_draft", {"kv": "window@0.05"}, 2048)[1]["kv"] == "window(sink=4,recent=98)"
    assert bench_batch.sized("self_draft", {"kv": "snapkv@0.25"}, 256)[1]["kv"] == "snapkv(budget=64,window=16)"
    assert bench_batch.sized("self_draft", {"kv": "quant(bits=4)"}, 256)[1]["kv"] == "quant(bits=4)"
