"""The KV question, both sides: how much of its cache can a self-drafter drop or quantize, and does it pay?

    python -m experiments.kv RESULTS [--source long2k] [--prompts 8] [--new-tokens 16]
                                     [--policies window,snapkv,quant4] [--retentions 5,10,25,50]
                                     [--shapes 'chain(1);chain(4)']     # default chain(4)
    python -m experiments.kv RESULTS --regime [--curve FILE]    # where it would pay: experiments.kv_regime

Owns the main job's KV step (settings from the grid file's `kv:` entry) and its reading. Per prompt, interleaved: a
timed plain greedy run, every policy x retention as a timed greedy `self_draft` run of `SHAPE` (token-identical to
plain), a second plain run. Per-token acceptance = accepted draft tokens over draft tokens tried; speedup = the plain
runs' mean time per token over the self-draft's, paired per prompt (95% bootstrap over prompts); A/A: plain 1 / 2.
Verdicts (`verdicts`): **acceptance-free down to r** when at r and every larger retention the acceptance CI's lower
end is >= 1 - MARGIN; **pays in time at r** when the speedup's CI lies above 1. Retention r of P tokens
(`policy_spec`): `window` keeps 4 sink + rP - 4 recent, `snapkv` a budget of rP, `quantN` a window of rP
packed at N bits with per-token keys, `quantNc` the same with per-channel keys (KIVI; whole groups of G tokens
kept, G = 32 where head_dim allows: up to G - 1 extra entries per boundary, counted in the bytes held). Knows nothing
about the grid's cells or the rest of the report.
"""

from __future__ import annotations

import argparse
import importlib
import copy
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

SOURCE = "long2k"
POLICIES = ("window", "snapkv", "quant4")
RETENTIONS = (0.05, 0.10, 0.25, 0.50)
SHAPE = "chain(4)"
MARGIN = 0.05
"""Acceptance-free: per-token acceptance's CI lower end >= 1 - MARGIN."""
CURVE_FILE = "kv_curve.json"
SEED = 0


def policy_spec(policy: str, retention: float, prompt_tokens: int) -> str:
    """The `kv=` spec of `policy` keeping `retention` (0 < r < 1) of a prompt of `prompt_tokens` positions.
    Example: window at 5% of 2000 -> keep 100 = `window(sink=4,recent=96)`."""
    if not 0 < retention < 1:
        raise ValueError(f"retention {retention:g}: use 0 < r < 1 (at 1 window and snapkv are the full cache)")
    keep = max(8, round(retention * prompt_tokens))
    if quant := re.fullmatch(r"quant([248])(c?)", policy):
        return f"window(sink=4,recent={keep - 4})+quant(bits={quant[1]},keys={'channel' if quant[2] else 'token'})"
    if policy == "window":
        return f"window(sink=4,recent={keep - 4})"
    if policy == "snapkv":
        return f"snapkv(budget={keep},window={min(32, keep)})"
    raise ValueError(f"unknown policy {policy!r}; choose from window, snapkv, quantN (N = 2, 4, 8; per-token keys), "
                     "quantNc (per-channel keys)")


def prompts(target, source: str, count: int) -> list[dict]:
    """The first `count` questions of the dataset `source` (first turns, chat template): [{id, kind, tokens}]."""
    from experiments.config import DatasetConfig
    from experiments.questions import load_questions

    questions = load_questions(DatasetConfig(source=source))[:count]
    if len(questions) < count:
        raise ValueError(f"source {source!r} holds {len(questions)} questions, {count} asked")
    return [{"id": q.question_id, "kind": q.category, "tokens": target.encode_prompt(q.turns[0])} for q in questions]


def shared_prefill(target):
    """A shallow copy of `target` whose first forward into an empty cache (the prefill, one row or a batch)
    runs each prompt once and hands later runs a copy of its entries: runs share a prompt's prefill."""
    shared, memo = copy.copy(target), {}

    def forward(tokens, cache, *args, **kwargs):
        key = (tuple(tokens.shape), tokens.numpy().tobytes())
        if cache.length:
            return target.forward(tokens, cache, *args, **kwargs)
        if key not in memo:
            memo.clear()  # one prompt at a time
            out = target.forward(tokens, cache, *args, **kwargs)
            memo[key] = ([(k.clone(), v.clone()) for k, v in cache.tensors()], cache.valid, out)
        entries, cache.valid, out = memo[key]
        if not cache.length:
            cache.append([(k.clone(), v.clone()) for k, v in entries])
        return out

    shared.forward = forward
    return shared


def timed_run(target, drafter, rows: list[list[int]], new_tokens: int, shape: str = SHAPE) -> dict:
    """One greedy decode of the prompts `rows` at once: {tokens (per row), steps [(seconds, tokens, rows, depth)],
    seconds_per_token, hits, tries, kv_bytes_per_token, kv_bytes, kv_entries, draft_forward_s} (the last: the drafter's
    time per draft forward; a chain drafts one node per forward; depth: the step's shortest draft, 0 for plain)."""
    from specdec.loop.decode import DecodeConfig, decode
    from specdec.runtime.packed_cache import held_bytes

    config = DecodeConfig(shape=shape, max_new_tokens=new_tokens, stop_on_eos=False, cache="dynamic", chat=False)
    tokens, steps, hits, tries, drafting, forwards = [[] for _ in rows], [], 0, 0, 0.0, 0
    for event in decode(target, drafter, rows, config):
        steps.append((event.times.total, sum(len(c) for c in event.committed), len(event.rows),
                      min(d.num_nodes for d in event.drafts)))
        drafting, forwards = drafting + event.times.propose, forwards + max(d.tokens.shape[-1] for d in event.drafts)
        for i, committed, draft, path in zip(event.rows, event.committed, event.drafts, event.paths):
            tokens[i] += committed
            hits, tries = hits + len(path), tries + min(len(path) + 1, draft.tokens.shape[-1])
    held = held_bytes(drafter.cache) if drafter is not None else None
    return {"tokens": [t[:new_tokens] for t in tokens], "steps": steps, "hits": hits, "tries": tries,
            "seconds_per_token": sum(s[0] for s in steps) / sum(s[1] for s in steps), "kv_bytes": held,
            "kv_entries": drafter.cache.length if drafter is not None else None,
            "kv_bytes_per_token": held / max(int(drafter.cache.next_positions.max()), 1) if held else None,
            "draft_forward_s": drafting / max(forwards, 1) if drafter is not None else None}


def measure(target, items: list[dict], policies, retentions, new_tokens: int, log=print,
            shapes: tuple[str, ...] = (SHAPE,)) -> list[dict]:
    """Rows {prompt, kind, prompt_tokens, policy, retention, shape, kv, acceptance, seconds_per_token,
    kv_bytes_per_token}: per prompt plain ("plain"), every policy x retention x shape, plain again ("plain2")."""
    from specdec.drafters import build

    shared, rows = shared_prefill(target), []
    for p in items:
        plan = [(q, r, shape) for q in policies for r in retentions for shape in shapes]
        for policy, retention, shape in [("plain", None, None), *plan, ("plain2", None, None)]:
            drafter, kv = None, None
            if retention is not None:
                kv = policy_spec(policy, retention, len(p["tokens"]))
                drafter = build("self_draft", target=target, kv=kv, cache="dynamic")
            run = timed_run(shared, drafter, [p["tokens"]], new_tokens, shape or SHAPE)
            if policy == "plain":
                path = run["tokens"]
            elif run["tokens"] != path:
                raise AssertionError(f"{p['id']} kv={kv}: greedy output differs from plain decoding")
            rows.append({"prompt": p["id"], "kind": p["kind"], "prompt_tokens": len(p["tokens"]), "policy": policy,
                         "retention": retention, "shape": shape, "kv": kv,
                         "seconds_per_token": run["seconds_per_token"],
                         "acceptance": run["hits"] / run["tries"] if run["tries"] else None,
                         **{k: run[k] for k in ("kv_bytes_per_token", "kv_bytes", "kv_entries", "draft_forward_s")}})
            log(f"  {p['id']} {policy} {'' if retention is None else f'{retention:.0%} {shape}'}: "
                f"{1000 * run['seconds_per_token']:.1f} ms/token" +
                ("" if drafter is None else f", acceptance {rows[-1]['acceptance']:.3f}"))
    return rows


# ---- verdict ---------------------------------------------------------------------------------------


def _ci(values: np.ndarray, rng: np.random.Generator, n_boot: int) -> tuple[float, list[float]]:
    """Mean of per-prompt values with a 95% percentile bootstrap interval over prompts."""
    boot = values[rng.integers(0, len(values), size=(n_boot, len(values)))].mean(1)
    return float(values.mean()), [float(x) for x in np.percentile(boot, [2.5, 97.5])]


def summarize(rows: list[dict], n_boot: int = 2000) -> dict:
    """{rows: [{policy, retention, shape, kv, acceptance, acceptance_ci, speedup, speedup_ci, kv_bytes_per_token,
    kv_bytes_per_entry (bytes held over entries held)}],
    verdicts: {policy: {acceptance_free, pays_in_time}} (`policy shape` with several shapes), control: {ratio, ci,
    verdict}}."""
    import pandas as pd

    rng = np.random.default_rng(SEED)
    df = pd.DataFrame(rows)
    df["shape"] = df.get("shape", pd.Series(SHAPE, index=df.index)).fillna(SHAPE)  # files from before --shapes
    several = df[df.retention.notna()]["shape"].nunique() > 1
    plain = df[df.policy == "plain"].set_index("prompt").seconds_per_token
    plain2 = df[df.policy == "plain2"].set_index("prompt").seconds_per_token
    base = (plain + plain2) / 2
    out, verdicts = [], {}
    for (policy, retention, shape), cell in df[df.retention.notna()].groupby(["policy", "retention", "shape"],
                                                                            sort=False):
        cell = cell.set_index("prompt")
        policy = f"{policy} {shape}" if several else policy
        acceptance, acceptance_ci = _ci(cell.acceptance.to_numpy(float), rng, n_boot)
        speedup, speedup_ci = _ci((base[cell.index] / cell.seconds_per_token).to_numpy(float), rng, n_boot)
        out.append({"policy": policy, "retention": float(retention), "shape": shape, "kv": cell.kv.iloc[0],
                    "acceptance": acceptance, "acceptance_ci": acceptance_ci, "speedup": speedup,
                    "speedup_ci": speedup_ci, "kv_bytes_per_token": float(cell.kv_bytes_per_token.mean()),
                    "kv_bytes_per_entry": float((cell.kv_bytes / cell.kv_entries).mean()) if "kv_entries" in cell
                    else float("nan")})
    for policy in dict.fromkeys(r["policy"] for r in out):
        points = sorted((r for r in out if r["policy"] == policy), key=lambda r: -r["retention"])
        free = None
        for r in points:
            if r["acceptance_ci"][0] < 1 - MARGIN:
                break
            free = r["retention"]
        pays = [r["retention"] for r in points if r["speedup_ci"][0] > 1]
        verdicts[policy] = {"acceptance_free": free, "pays_in_time": min(pays) if pays else None}
    ratio, ci = _ci((plain / plain2).to_numpy(float), rng, n_boot)
    control = {"ratio": ratio, "ci": ci, "verdict": "within" if ci[0] <= 1 <= ci[1] else "outside"}
    return {"rows": out, "verdicts": verdicts, "control": control}


# ---- the report's section --------------------------------------------------------------------------


def _pct(retention: float | None) -> str:
    return "none" if retention is None else f"{100 * retention:g}%"


def report_parts(results: str | os.PathLike, n_boot: int = 2000) -> tuple[list[str], list[str], dict | None]:
    """(markdown lines, verdict lines, JSON summary) of RESULTS/kv_curve.json; ([], [], None) without it."""
    path = Path(results) / CURVE_FILE
    if not path.exists():
        return [], [], None
    data = json.loads(path.read_text(encoding="utf-8"))
    s, summary = data["settings"], summarize(data["rows"], n_boot)
    control, shapes = summary["control"], " / ".join(dict.fromkeys(r["shape"] for r in summary["rows"]))
    verdict_lines = [f"- KV compression (self_draft {shapes}, {s['prompts']} prompts of >= {s['min_tokens']} tokens): "
                     + "; ".join(f"{p} acceptance-free down to {_pct(v['acceptance_free'])}, pays in time at "
                                 f"{_pct(v['pays_in_time'])}" for p, v in summary["verdicts"].items())
                     + f"; A/A timing control: {control['verdict']}"]
    md = ["", "## The KV question: how much cache does a self-drafter need, and does it pay?", "",
          f"The `self_draft` drafter (the target's own weights) over a compressed view of the target's KV, "
          f"greedy {shapes}, on {s['prompts']} prompts of `{s['source']}` ({s['min_tokens']}..{s['max_tokens']} "
          f"tokens), {s['new_tokens']} tokens each, every run checked token-identical to plain decoding; "
          f"{s['cpu']}, {s['threads']} thread(s), measured in {s['seconds']:.0f} s. Acceptance: accepted draft "
          "tokens over tokens tried (per-token argmax agreement). Speedup: plain time per token (two runs "
          "bracketing the prompt's runs) over the self-draft's, prefill excluded; 95% bootstrap CIs over "
          f"prompts. Acceptance-free: CI lower end >= {1 - MARGIN:.2f} at that retention and above. Pays: "
          "speedup CI above 1.", "",
          "| policy | retention | kv | KV bytes / position | bytes / entry held | acceptance | speedup |",
          "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        md.append(f"| {r['policy']} | {_pct(r['retention'])} | `{r['kv']}` | {r['kv_bytes_per_token']:.0f} | "
                  f"{r['kv_bytes_per_entry']:.0f} | "
                  f"{r['acceptance']:.3f} [{r['acceptance_ci'][0]:.3f}, {r['acceptance_ci'][1]:.3f}] | "
                  f"{r['speedup']:.2f} [{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}] |")
    md += ["", f"A/A control (plain over plain, timed apart): {control['ratio']:.3f} [{control['ci'][0]:.3f}, "
           f"{control['ci'][1]:.3f}], **{control['verdict']}**.", ""]
    if "physics" in s and "kv_bytes" in data["rows"][0]:
        md += physics_lines(s, data["rows"]) + [answer(s, data["rows"], summary), ""]
    compact = {"rows": [{k: r[k] for k in ("policy", "retention", "shape", "acceptance", "acceptance_ci", "speedup",
                                            "speedup_ci")} for r in summary["rows"]],
               "verdicts": summary["verdicts"], "control": control["verdict"], "prompts": s["prompts"],
               "seconds": round(s["seconds"], 1)}
    return md, verdict_lines, compact


def physics_facts(target) -> int:
    """Bytes of the full-precision KV of one position."""
    from specdec.drafters.kv_policy import model_facts

    cfg = target.model.config.get_text_config()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * model_facts(target).head_dim * target.dtype.itemsize


def physics(target) -> dict:
    """{weight_bytes, kv_bytes_per_position (the full fp cache), bandwidth (bytes/s: `specdec.tune`'s
    timed read of as many bytes as the weights)}: the memory a step must move, and how fast it moves."""
    from specdec.quant import weight_bytes
    from specdec.tune import read_seconds

    weights = weight_bytes(target.model)
    return {"weight_bytes": weights, "kv_bytes_per_position": physics_facts(target),
            "bandwidth": weights / read_seconds(weights)}


def physics_lines(settings: dict, rows: list[dict]) -> list[str]:
    """Markdown: per plain step and per draft forward, the measured time beside the memory floor
    (weight bytes + KV bytes held) / bandwidth."""
    import pandas as pd

    df, phys = pd.DataFrame(rows), settings["physics"]
    floor = lambda kv_bytes: 1000 * (phys["weight_bytes"] + kv_bytes) / phys["bandwidth"]  # noqa: E731
    plain = df[df.policy.isin(["plain", "plain2"])]
    full_kv = phys["kv_bytes_per_position"] * plain.prompt_tokens.mean()
    lines = ["", f"What the memory allows: {phys['weight_bytes'] / 1e6:.0f} MB of weights, "
             f"{phys['bandwidth'] / 1e9:.1f} GB/s measured copy bandwidth; floor = (weights + KV held) / bandwidth.",
             "",
             "| step | KV held (MB) | measured (ms) | floor (ms) |", "|---|---|---|---|",
             f"| plain step | {full_kv / 1e6:.1f} | {1000 * plain.seconds_per_token.mean():.1f} | "
             f"{floor(full_kv):.1f} |"]
    for (policy, retention), cell in df[df.retention.notna()].groupby(["policy", "retention"], sort=False):
        lines.append(f"| {policy} {retention:.0%} draft forward | {cell.kv_bytes.mean() / 1e6:.1f} | "
                     f"{1000 * cell.draft_forward_s.mean():.1f} | {floor(cell.kv_bytes.mean()):.1f} |")
    return [*lines, ""]


def answer(settings: dict, rows: list[dict], summary: dict) -> str:
    """The KV question's answer in one paragraph, from the stored rows: acceptance, time, where it flips."""
    best = max(summary["rows"], key=lambda r: r["speedup"])
    free = {p: v["acceptance_free"] for p, v in summary["verdicts"].items()}
    pays = [p for p, v in summary["verdicts"].items() if v["pays_in_time"] is not None]
    phys, drafts = settings["physics"], [r for r in rows if r["retention"] is not None]
    plain = [r for r in rows if r["retention"] is None]
    small = min(drafts, key=lambda r: r["kv_bytes"])
    full_kv = phys["kv_bytes_per_position"] * np.mean([r["prompt_tokens"] for r in plain])
    measured = small["draft_forward_s"] / np.mean([r["seconds_per_token"] for r in plain])
    floor = (phys["weight_bytes"] + small["kv_bytes"]) / (phys["weight_bytes"] + full_kv)
    alpha = best["acceptance"]
    return ("**Answer.** Acceptance: " + "; ".join(f"{p} acceptance-free down to {_pct(r)}" for p, r in free.items())
            + f" (per-token agreement, lower CI end >= {1 - MARGIN:.2f}). Time: "
            + (f"{', '.join(pays)} pay (speedup CI above 1)" if pays else "no policy pays")
            + f"; the best is {best['policy']} at {_pct(best['retention'])}, {best['speedup']:.2f}x "
            f"[{best['speedup_ci'][0]:.2f}, {best['speedup_ci'][1]:.2f}]. A draft forward over the smallest cache "
            f"({small['kv']}) costs {measured:.0%} of a plain step ({floor:.0%} by bytes moved, weights plus KV: the "
            f"weights are read either way), while {SHAPE} at acceptance {alpha:.2f} yields about "
            f"{sum(alpha ** i for i in range(5)):.1f} tokens per step of four draft forwards and a verification. "
            "It would flip where the KV, not the weights, dominates a step (many rows x long contexts share one "
            "read of the weights) or where verifying five tokens costs about one step (a GPU).")


# ---- the command -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    if "--regime" in (sys.argv[1:] if argv is None else argv):  # the regime command builds on this module: by name
        return importlib.import_module("experiments.kv_regime").main(argv)
    ap = argparse.ArgumentParser(description="The KV step: acceptance and timed speedup per policy x retention.")
    ap.add_argument("results", help="the results directory (the report reads RESULTS/kv_curve.json)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--source", default=SOURCE, help="dataset source of the prompts (a suite name or a file)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--retentions", default=",".join(f"{100 * r:g}" for r in RETENTIONS), help="percent")
    ap.add_argument("--shapes", default=SHAPE, help="draft shapes, ';'-separated, e.g. 'chain(1);chain(4)'")
    args = ap.parse_args(argv)
    import specdec
    from experiments.leaderboard import atomic_text
    from specdec.measure.records import describe_machine

    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        target = specdec.load_target(args.model)
        phys = physics(target)
        items = prompts(target, args.source, args.prompts)
        print(f"kv: {len(items)} prompts of {[len(p['tokens']) for p in items]} tokens", flush=True)
        rows = measure(target, items, [p for p in args.policies.split(",") if p],
                       [float(r) / 100 for r in args.retentions.split(",")], args.new_tokens,
                       log=lambda line: print(line, flush=True), shapes=tuple(args.shapes.split(";")))
    except ValueError as err:
        print(f"experiments.kv: error: {err}", file=sys.stderr)
        return 2
    lengths = [len(p["tokens"]) for p in items]
    settings = {"model": target.label, "source": args.source, "prompts": len(items), "min_tokens": min(lengths),
                "max_tokens": max(lengths), "new_tokens": args.new_tokens, "physics": phys,
                "cpu": "{name} (family {family}, model {model})".format(**describe_machine()),
                "seconds": time.perf_counter() - started, "threads": torch.get_num_threads()}
    path = Path(args.results) / CURVE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_text(path, json.dumps({"settings": settings, "rows": rows}, indent=1))
    print(f"kv: wrote {path} in {settings['seconds']:.0f} s")
    print(json.dumps({"kv": report_parts(args.results)[2]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
