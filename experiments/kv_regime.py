"""The KV regime map: where would a self-drafter over a compressed cache pay, and does the map hold?

    python -m experiments.kv RESULTS --regime [--curve FILE] [--cells 1x1024,4x2048,16x1024]

Phases: **surface** (seconds f of `Target.forward` of B rows after c cached entries for plain, draft, verify and
commit, a window's per-step compaction, the prefill rate, and per batch the decode loop's own cost per step, o(B,
plain) and o(B, spec): a real plain and self-draft `decode` over synthetic constant prefills, less the forwards
priced at the same point), **acceptance** per policy x retention (RESULTS/kv_curve.json), **map**: per batch x
context x policy x retention a `SHAPE` step yields E = 1 + a + .. + a^4 tokens per row (a: per-token acceptance)
over R = rC retained entries, so speedup = E (f(B, C, plain) + o(B, plain)) / (4 f(B, R, draft) + f(B, R, commit)
[+ f(B, R, compact) for window] + f(B, C, verify) + o(B, spec)), f linear in B and c (`--curve FILE`: verify =
f(B, C, plain) x the curve's width-5 ratio), then **cells**: the best predicted point per `--cells` B x C and the
most favourable cell that fits, predicted then timed over the steady steps (the batch full, every draft whole; 95%
bootstrap over steps). `--surface FILE` reuses a stored surface. Last line: JSON {cells, map, median_abs_error}.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from experiments import kv

BATCHES, CONTEXTS = (1, 4, 16), (64, 512, 2048, 8192)
MAP_BATCHES, MAP_CONTEXTS = (1, 2, 4, 8, 16), (1024, 2048, 4096, 8192)
CELLS = ((1, 1024), (4, 2048), (16, 1024))
WIDTH, DRAFTS, REPEATS, LOOP_STEPS = 5, 4, 2, 4
MEMORY = 24 * 2**30
MAP_FILE = "kv_regime"


def _entries(target, batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Constant (keys, values) [batch, kv_heads, context, head_dim] per layer."""
    from specdec.drafters.kv_policy import model_facts

    cfg = target.model.config.get_text_config()
    shape = (batch, cfg.num_key_value_heads, context, model_facts(target).head_dim)
    return [(torch.full(shape, 0.01, dtype=target.dtype), torch.full(shape, 0.01, dtype=target.dtype))
            for _ in range(cfg.num_hidden_layers)]


def _filled(target, batch: int, context: int, holes: bool):
    """A `KVCache` of `context` constant entries per row (one hole per row when `holes` and batch > 1)."""
    from specdec.runtime.cache import KVCache

    cache = KVCache()
    cache.append(_entries(target, batch, context))
    if holes and batch > 1:
        cache.valid = torch.ones(batch, context, dtype=torch.bool)
        cache.valid[:, 0] = False
    return cache


def _time_kind(target, kind: str, batch: int, context: int) -> float:
    """Seconds of one forward of `kind` after `context` entries per row: plain (1 token), verify (a chain
    of `WIDTH`), draft (per forward of a draft: the root, then `DRAFTS` - 1 nodes under their block as
    `self_draft` runs them, the cache growing); commit: the drafter's commit of a step, no forward; compact: a
    window of `context` entries dropping a step's `WIDTH` new ones (`Window.after_commit`)."""
    from specdec.drafters.kv_policy import Window

    cache = _filled(target, batch, context + (WIDTH if kind == "compact" else 0), kind != "plain")
    new = [(k[..., :WIDTH, :].clone(), v[..., :WIDTH, :].clone()) for k, v in cache.tensors()]
    tokens, start = torch.ones(batch, 1, dtype=torch.long), time.perf_counter()
    if kind == "compact":
        Window(sink=4, recent=max(1, context - 4)).after_commit(cache)
    elif kind == "commit":  # the drafter's commit: a step's target entries appended, its block kept
        cache.append(new)
        cache.append_valid(None, WIDTH)
        cache.keep_rows(context, [[0, 1]] * batch)
    elif kind == "verify":
        target.forward(torch.ones(batch, WIDTH, dtype=torch.long), cache, torch.arange(-1, WIDTH - 1))
    else:
        target.forward(tokens, cache)
        for m in range(1, DRAFTS if kind == "draft" else 1):
            parents = torch.arange(-1, m - 1)
            target.forward(tokens, cache, parents.expand(batch, m) if batch > 1 else parents)
    return (time.perf_counter() - start) / (DRAFTS if kind == "draft" else 1)


def synthetic_prefill(target):
    """A shallow copy of `target` whose prefill (a forward into an empty cache) stores constant entries instead of
    running the model: the surface's loops time decode steps, never a prefill."""
    from specdec.runtime.model import ForwardOut

    synthetic = copy.copy(target)

    def forward(tokens, cache, *args, valid=None, **kwargs):  # tokens [B, n]
        if cache.length:
            return target.forward(tokens, cache, *args, valid=valid, **kwargs)
        batch, n = tokens.shape
        cache.append(_entries(target, batch, n))
        cache.append_valid(valid, n)
        hidden = torch.zeros(1, 1, target.hidden_size, dtype=target.dtype).expand(batch, n, -1)  # [B, n, H]
        return ForwardOut(logits=torch.zeros(batch, 1, target.model.config.vocab_size), hidden=hidden)

    synthetic.forward = forward
    return synthetic


def loop_step(target, batch: int, context: int, spec: bool) -> float:
    """Median seconds of a steady step (after the first; the batch full, every draft whole) of a real plain or
    `self_draft` (kv=full) greedy decode of `batch` synthetic rows after `context` constant entries."""
    from specdec.drafters import build

    drafter = build("self_draft", target=target, kv="full", cache="dynamic") if spec else None
    rows = [[2 + b % 50] * context for b in range(batch)]  # rows differ in their root, so in acceptance
    steps = kv.timed_run(synthetic_prefill(target), drafter, rows, (LOOP_STEPS + 1) * (WIDTH if spec else 1))
    return statistics.median(s[0] for s in steps["steps"][1:] if s[2] == batch and s[3] >= (DRAFTS if spec else 0))


def step_s(surf: dict, batch: int, context: float, kept: float, policy: str | None = None,
           curve=None) -> tuple[float, float]:
    """(plain step, self-draft step) seconds at (batch, context) with `kept` entries in the draft's cache."""
    loop = surf.get("overhead", {})
    over = {k: float(np.interp(batch, surf["batches"], loop[k])) if k in loop else 0.0 for k in ("plain", "spec")}
    plain = forward_s(surf, "plain", batch, context)
    verify = plain * curve.ratio(WIDTH, context) if curve else forward_s(surf, "verify", batch, context)
    compact = forward_s(surf, "compact", batch, kept) if policy == "window" and "compact" in surf else 0.0
    draft = DRAFTS * forward_s(surf, "draft", batch, kept) + forward_s(surf, "commit", batch, kept) + compact
    return plain + over["plain"], draft + verify + over["spec"]


def surface(target, batches, contexts, bar=lambda items: items) -> dict:
    """{"plain"|"draft"|"verify"|"commit"|"compact": [[seconds per context] per batch], batches, contexts, prefill:
    [a, q], overhead: {plain, spec: [seconds per batch]}}: the median of `REPEATS` passes over the grid (one untimed
    first), each a fresh cache per point; a prefill of n tokens at context n costs n (a + q n) seconds, fitted from two
    prompts; the loop's cost per step (`loop_step`) less `step_s` without it, at the second context."""
    kinds, times = ("plain", "draft", "verify", "commit", "compact"), {}
    for _ in bar(range(REPEATS + 1)):
        for b in batches:
            for c in contexts:
                for k in kinds:
                    times.setdefault((k, b, c), []).append(_time_kind(target, k, b, c))
    small, large, per_token = min(contexts[-1], 512), min(contexts[-1], 2048), []
    for n in (small, large):
        start = time.perf_counter()
        target.forward(torch.ones(1, n, dtype=torch.long), _filled(target, 1, 0, False))
        per_token.append((time.perf_counter() - start) / n)
    q = (per_token[1] - per_token[0]) / max(large - small, 1)
    surf = {**{k: [[statistics.median(times[k, b, c][1:]) for c in contexts] for b in batches] for k in kinds},
            "batches": list(batches), "contexts": list(contexts), "prefill": [per_token[0] - q * small, max(q, 0.0)]}
    at = contexts[min(1, len(contexts) - 1)]
    loops = {b: (loop_step(target, b, at, False), loop_step(target, b, at, True)) for b in batches}
    priced = {b: step_s(surf, b, at, at) for b in batches}
    surf["overhead"] = {k: [loops[b][i] - priced[b][i] for b in batches] for i, k in enumerate(("plain", "spec"))}
    return surf


def forward_s(surf: dict, kind: str, batch: int, context: float) -> float:
    """`surface` seconds at (batch, context), linear in context then in batch (held beyond the grid)."""
    rows = [np.interp(context, surf["contexts"], row) for row in surf[kind]]
    return float(np.interp(batch, surf["batches"], rows))


def predict(surf: dict, alpha: float, batch: int, context: int, retention: float, curve=None,
            policy: str | None = None) -> float:
    """Predicted self-draft speedup over plain decoding (module docstring)."""
    plain, spec = step_s(surf, batch, context, max(8, retention * context), policy, curve)
    return sum(alpha ** i for i in range(DRAFTS + 1)) * plain / spec


def regime_map(target, surf: dict, accept: dict, batches, contexts, curve=None) -> list[dict]:
    """One row per batch x context x (policy, retention): predicted speedup, prefill estimate and memory
    (weights, the target's cache, the shared prefill's copy of it, the draft's copy at the prefill)."""
    (a, q), weights = surf["prefill"], sum(p.nbytes for p in target.model.parameters())
    return [{"batch": b, "context": c, "policy": p, "retention": r, "acceptance": alpha,
             "predicted": predict(surf, alpha, b, c, r, curve, p), "prefill_s": b * c * (a + q * c),
             "memory": weights + 3 * b * c * kv.physics_facts(target)}
            for b in batches for c in contexts for (p, r), alpha in sorted(accept.items())]


def draw(rows: list[dict], path: Path, title: str) -> list[str]:
    """PNG of the map (a panel per policy x retention, batch against context, break-even contour) and
    its markdown table (rows policy, retention, batch; columns context)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["policy"], r["retention"]) for r in rows})
    policies, retentions = sorted({k[0] for k in keys}), sorted({k[1] for k in keys})
    batches, contexts = sorted({r["batch"] for r in rows}), sorted({r["context"] for r in rows})
    at = {(r["policy"], r["retention"], r["batch"], r["context"]): r["predicted"] for r in rows}
    fig, axes = plt.subplots(len(policies), len(retentions), figsize=(2.4 * len(retentions) + 1.5,
                             2.4 * len(policies) + 0.6), squeeze=False, sharey=True, constrained_layout=True)
    for ax, (p, r) in ((axes[policies.index(p)][retentions.index(r)], (p, r)) for p, r in keys):
        z = np.array([[at[p, r, b, c] for c in contexts] for b in batches])
        im = ax.imshow(z, origin="lower", cmap="RdYlGn", vmin=0, vmax=2, aspect="auto")
        if min(z.shape) > 1 and z.min() < 1 < z.max():
            ax.contour(z, levels=[1.0], colors="k")
        ax.set(title=f"{p} {r:.0%}", xticks=range(len(contexts)), xlabel="context", ylabel="batch",
               xticklabels=[f"{c / 1024:g}K" if c >= 1024 else c for c in contexts],
               yticks=range(len(batches)), yticklabels=batches)
    fig.colorbar(im, ax=axes, label="predicted speedup (1 = break-even)")
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ["| policy | retention | batch | " + " | ".join(f"{c} ctx" for c in contexts) + " |",
            "|---|---|---|" + "---|" * len(contexts)] + [
        f"| {p} | {r:.0%} | {b} | " + " | ".join(f"{at[p, r, b, c]:.2f}" for c in contexts) + " |"
        for p, r in keys for b in batches]


def cell_prompts(items: list[dict], batch: int, context: int) -> list[list[int]]:
    """Row b: the last `context` tokens of prompts b, b+1, ... (cyclic) concatenated."""
    rows = []
    for b in range(batch):
        tokens, j = [], b
        while len(tokens) < context:
            tokens, j = items[j % len(items)]["tokens"] + tokens, j + 1
        rows.append(tokens[-context:])
    return rows


def time_cell(target, items, cell: dict, new_tokens: int, n_boot: int = 2000) -> dict:
    """Timed plain / self-draft / plain decodes of one cell: {measured, ci, measured_acceptance, spec, all_steps}:
    measured over the steady steps (the batch full, drafts as deep as the run's deepest), all_steps over every step."""
    from specdec.drafters import build

    rows, shared = cell_prompts(items, cell["batch"], cell["context"]), kv.shared_prefill(target)
    spec = kv.policy_spec(cell["policy"], cell["retention"], cell["context"])
    runs = {name: kv.timed_run(shared, build("self_draft", target=target, kv=spec, cache="dynamic")
                               if name == "draft" else None, rows, new_tokens) for name in ("plain", "draft", "plain2")}
    deepest = {k: max(s[3] for s in run["steps"]) for k, run in runs.items()}
    steps = {k: np.array([s[:2] for s in run["steps"] if s[2] == len(rows) and s[3] == deepest[k]])
             for k, run in runs.items()}
    rng = np.random.default_rng(kv.SEED)

    def per_token(name: str, boot: bool) -> float:
        run = steps[name][rng.integers(0, len(steps[name]), len(steps[name]))] if boot else steps[name]
        return run[:, 0].sum() / run[:, 1].sum()

    def ratio(boot: bool) -> float:
        return (per_token("plain", boot) + per_token("plain2", boot)) / 2 / per_token("draft", boot)

    ci = np.percentile([ratio(True) for _ in range(n_boot)], [2.5, 97.5])
    every = (runs["plain"]["seconds_per_token"] + runs["plain2"]["seconds_per_token"]) / 2
    return {"measured": float(ratio(False)), "ci": [float(x) for x in ci], "spec": spec,
            "all_steps": every / runs["draft"]["seconds_per_token"],
            "measured_acceptance": runs["draft"]["hits"] / max(runs["draft"]["tries"], 1)}


def choose_cells(rows: list[dict], cells, budget_s: float, limit: int) -> list[dict]:
    """The best (policy, retention) at each of `cells` (B, C), then the most favourable map cell within
    MEMORY and the prefill budget (or the next best at a B x C not chosen yet)."""
    def best(pool):
        return max(pool, key=lambda r: r["predicted"]) if pool else None

    chosen = [best([r for r in rows if (r["batch"], r["context"]) == bc]) for bc in cells]
    chosen = [r for r in chosen if r is not None]
    fits = [r for r in rows if r["memory"] <= MEMORY and r["prefill_s"] <= budget_s and r["context"] < limit
            and (r["batch"], r["context"]) not in {(c["batch"], c["context"]) for c in chosen}]
    top = best(fits)
    return chosen + ([dict(top, favourable=True)] if top else [])


def physics_line(target, batch: int = 8, context: int = 4096, retention: float = 0.05) -> str:
    """A `retention` draft step against a plain step at batch x context, measured and by bytes."""
    phys = kv.physics(target)
    weights, per_position, bandwidth = phys["weight_bytes"], phys["kv_bytes_per_position"], phys["bandwidth"]
    kept = max(8, round(retention * context))
    plain, draft = _time_kind(target, "plain", batch, context), _time_kind(target, "draft", batch, kept)
    floor = [(weights + batch * n * per_position) / bandwidth for n in (context, kept)]
    return (f"physics at batch {batch} x {context}: plain step {1e3 * plain:.0f} ms (floor {1e3 * floor[0]:.0f} ms = "
            f"{weights / 1e6:.0f} MB weights + {batch * context * per_position / 1e6:.0f} MB KV at "
            f"{bandwidth / 1e9:.1f} GB/s); {retention:.0%} draft step {1e3 * draft:.0f} ms (floor {1e3 * floor[1]:.0f}"
            f" ms, {batch * kept * per_position / 1e6:.0f} MB KV): draft/plain {draft / plain:.2f} measured, "
            f"{floor[1] / floor[0]:.2f} by bytes; <= half a plain step: {'yes' if draft <= plain / 2 else 'no'}")


def run_regime(target, items: list[dict], accept: dict, results: Path, *, batches=BATCHES, contexts=CONTEXTS,
               map_batches=MAP_BATCHES, map_contexts=MAP_CONTEXTS, cells=CELLS, curve=None, new_tokens: int = 32,
               budget_s: float = 200.0, physics: tuple[int, int] | None = (8, 4096), stored_surface: dict | None = None,
               log=print) -> dict:
    """The four phases (module docstring); returns the last line's JSON object."""
    from tqdm import tqdm

    bar = lambda name: lambda items: tqdm(items, desc=name, mininterval=5)  # noqa: E731
    surf = stored_surface or surface(target, batches, contexts, bar("surface"))
    rows = regime_map(target, surf, accept, map_batches, map_contexts)
    results.mkdir(parents=True, exist_ok=True)
    png = results / f"{MAP_FILE}.png"
    md = draw(rows, png, f"{target.label}: predicted {kv.SHAPE} self-draft speedup")
    if "overhead" in surf:
        md += ["", "Loop cost per step beyond the priced forwards, batch " + ", ".join(
            f"{b}: plain {1e3 * p:.1f} ms, self-draft {1e3 * d:.1f} ms"
            for b, p, d in zip(surf["batches"], surf["overhead"]["plain"], surf["overhead"]["spec"])) + "."]
    if curve is not None:
        other = regime_map(target, surf, accept, map_batches, map_contexts, curve)
        md += ["", f"Under the width curve of {curve.machine} ({curve.device}, batch {curve.batch}):", ""]
        md += draw(other, results / f"{MAP_FILE}-curve.png", f"under {curve.machine}'s width curve")
    from specdec.measure.records import describe_machine

    head = ["# KV regime map: " + "{name} (family {family}, model {model})".format(**describe_machine()), "",
            f"`python -m experiments.kv {results} --regime`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{torch.get_num_threads()} thread(s); ![map]({png.name})", ""]
    (results / f"{MAP_FILE}.md").write_text("\n".join(head + md) + "\n", encoding="utf-8")
    (results / f"{MAP_FILE}.json").write_text(json.dumps({"surface": surf, "map": rows}, indent=1), encoding="utf-8")
    log("\n".join(md))
    if physics:
        log(physics_line(target, *physics))
    out = []
    for cell in tqdm(choose_cells(rows, cells, budget_s, target.context_length - new_tokens - 8), desc="cells"):
        log(f"cell batch {cell['batch']} x context {cell['context']}, {cell['policy']} {cell['retention']:.0%}: "
            f"predicted {cell['predicted']:.2f}x (acceptance {cell['acceptance']:.2f})"
            + (" [most favourable that fits]" if cell.get("favourable") else ""))
        timed = time_cell(target, items, cell, new_tokens)
        log(f"  measured {timed['measured']:.2f}x [{timed['ci'][0]:.2f}, {timed['ci'][1]:.2f}] "
            f"(acceptance {timed['measured_acceptance']:.2f}, {timed['spec']}; every step {timed['all_steps']:.2f}x)")
        out.append({k: cell[k] for k in ("batch", "context", "policy", "retention", "predicted")}
                   | {k: timed[k] for k in ("measured", "ci")})
    errors = [abs(c["predicted"] / c["measured"] - 1) for c in out]
    return {"cells": out, "map": str(png), "median_abs_error": float(np.median(errors)) if errors else None}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="experiments.kv --regime", description="The KV regime map (module docstring).")
    ap.add_argument("results")
    ap.add_argument("--regime", action="store_true")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--source", default=kv.SOURCE)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--curve", help="a LatencyCurve JSON file: draw the map under its width curve too")
    ap.add_argument("--cells", default=",".join(f"{b}x{c}" for b, c in CELLS), help="BxC,... timed besides the best")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--surface", help="a kv_regime.json whose surface to reuse rather than measure")
    ap.add_argument("--prefill-budget", type=float, default=200.0, help="seconds of prefill the best cell may take")
    args = ap.parse_args(argv)
    import specdec
    from specdec.core.curve import LatencyCurve

    torch.set_num_threads(1)
    target, results = specdec.load_target(args.model), Path(args.results)
    items = kv.prompts(target, args.source, args.prompts)
    stored = results / kv.CURVE_FILE
    if not stored.exists():
        print(f"regime: no {stored}: measuring acceptance (experiments.kv {results})", flush=True)
        kv.main([str(results), "--model", args.model, "--source", args.source, "--prompts", str(args.prompts)])
    summary = kv.summarize(json.loads(stored.read_text(encoding="utf-8"))["rows"], 10)["rows"]
    accept = {(r["policy"], r["retention"]): r["acceptance"] for r in summary
              if not r["policy"].startswith("quant")}  # a packed cache serves one row: not mapped
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",") if c]
    curve = LatencyCurve.load(args.curve) if args.curve else None
    summary = run_regime(target, items, accept, results, cells=cells, curve=curve, new_tokens=args.new_tokens,
                         budget_s=args.prefill_budget, log=lambda line: print(line, flush=True),
                         stored_surface=json.loads(Path(args.surface).read_text())["surface"] if args.surface else None)
    print(json.dumps(summary))
    return 0
