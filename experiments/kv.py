"""The KV question: how much of its cache can a self-drafter drop or quantize before acceptance suffers?

    python -m experiments.kv RESULTS [--prompts 4] [--context 2048] [--new-tokens 64] [--depth 12]

Owns the reduced KV-retention curve the main job runs (settings from the grid file's `kv:` entry) and
its reading: long ledger prompts (`long_prompts`); per KV policy x retention, the `self_draft` drafter
walked along the target's greedy path with its cache synced to the target's exact K/V (`token_stats`:
greedy acceptance, TV, KL, and on the first `mal_prompts` prompts the measured MAL); the verdict
(`verdict`: per policy, the lowest retention whose acceptance ratio to the full cache has a 95%
bootstrap CI with lower end >= 1 - MARGIN there and above; the A/A control must read "within"); and
the report's KV section (`report_parts`).

Retention r of a prompt of P tokens (`policy_spec`): `window` keeps 4 sink + rP - 4 recent entries,
`snapkv` a budget of rP, `quantN` a window of rP N-bit entries (at 100% every entry quantized); 100%
of window and snapkv is the full cache. Knows nothing about the grid's cells or the rest of the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

SUITE = Path(__file__).parent / "prompts" / "long.jsonl"
POLICIES = ("window", "snapkv", "quant4")
RETENTIONS = (0.05, 0.25, 1.0)
MARGIN = 0.05
"""Within: per-token acceptance's CI lower end >= (1 - MARGIN) x the full cache's."""
CURVE_FILE = "kv_curve.json"
SEED = 0


def policy_spec(policy: str, retention: float, prompt_tokens: int) -> str:
    """The `kv=` spec of `policy` keeping `retention` of a prompt of `prompt_tokens` positions.
    Example: window at 5% of 2000 -> keep 100 = `window(sink=4,recent=96)`."""
    keep = max(8, round(retention * prompt_tokens))
    if policy.startswith("quant") and policy[len("quant"):].isdigit():
        bits = int(policy[len("quant"):])
        return f"quant(bits={bits})" if retention >= 1 else f"window(sink=4,recent={keep - 4})+quant(bits={bits})"
    if policy not in ("window", "snapkv", "full"):
        raise ValueError(f"unknown policy {policy!r}; choose from window, snapkv, quantN (N = 2, 4, 8)")
    if retention >= 1 or policy == "full":
        return "full"
    if policy == "window":
        return f"window(sink=4,recent={keep - 4})"
    return f"snapkv(budget={keep},window={min(32, keep)})"


# ---- prompts ---------------------------------------------------------------------------------------


def _ledger(suite: Path = SUITE) -> tuple[str, list[str], str, dict[str, str]]:
    """(header, sections, needle note, {kind: question}) of the suite's longest ledger."""
    items = [json.loads(line) for line in suite.read_text(encoding="utf-8").splitlines() if line.strip()]
    longest = max(items, key=lambda d: len(d["turns"][0]))
    paragraphs = longest["turns"][0].split("\n\n")
    needle = [p for p in paragraphs if p.startswith("Note for the record")]
    sections = [p for p in paragraphs if p.startswith("Section ")]
    if len(needle) != 1 or len(sections) < 8:
        raise ValueError(f"{suite}: {longest['question_id']} has {len(needle)} needle notes and {len(sections)} "
                         "sections; a ledger needs one 'Note for the record' paragraph and >= 8 'Section' paragraphs")
    questions = {d["category"].removeprefix("long-"): d["turns"][0].split("\n\n")[-1] for d in items}
    return paragraphs[0], sections, needle[0], questions


def long_prompts(target, count: int, context: int, kinds: tuple[str, ...] = ("retrieval", "summary"),
                 suite: Path = SUITE) -> list[dict]:
    """`count` prompts of at most `context` tokens (chat template included): prompt i starts the ledger at
    section i * S / count (wrapping round), keeps whole sections while they fit, puts the needle note at
    depth (i + 0.5) / count, and asks kind i mod len(kinds). Returns [{id, kind, tokens}]."""
    header, sections, needle, questions = _ledger(suite)
    missing = [k for k in kinds if k not in questions]
    if missing or count < 1:
        raise ValueError(f"long_prompts: count {count} (need >= 1), kinds {missing} not in {sorted(questions)}")
    lengths = [len(target.tokenizer.encode(s, add_special_tokens=False)) for s in sections]
    fixed = len(target.encode_prompt("\n\n".join([header, needle, max(questions.values(), key=len)])))
    out = []
    for i in range(count):
        start, kept, used = i * len(sections) // count, [], fixed
        for j in range(len(sections)):
            k = (start + j) % len(sections)
            if used + lengths[k] + 2 > context:
                break
            kept.append(sections[k])
            used += lengths[k] + 2
        if len(kept) < 2:
            raise ValueError(f"long_prompts: context {context} tokens holds {len(kept)} ledger sections; use >= 512")
        kept.insert(round((i + 0.5) / count * len(kept)), needle)
        kind = kinds[i % len(kinds)]
        tokens = target.encode_prompt("\n\n".join([header, *kept, questions[kind]]))
        while len(tokens) > context:  # the section estimate was short: drop the last section
            kept.pop(-1 if kept[-1] != needle else -2)
            tokens = target.encode_prompt("\n\n".join([header, *kept, questions[kind]]))
        out.append({"id": f"ledger-{context}-{i}-{kind}", "kind": kind, "tokens": tokens})
    return out


# ---- measurement -----------------------------------------------------------------------------------


def reference(target, prompt: list[int], new_tokens: int) -> dict:
    """The target's greedy path of `new_tokens` tokens after `prompt` (its full cache)."""
    from specdec import generate

    return {"path": generate(target, None, prompt, max_new_tokens=new_tokens, stop_on_eos=False, chat=False).token_ids}


def token_stats(target, drafter, prompt: list[int], ref: dict) -> dict[str, list[float]]:
    """Per token of the path: greedy acceptance (0/1), TV and KL(target || draft) of the drafter's
    next-token law against the target's on its full cache. Teacher-forced through the loop's events:
    every step the drafter drafts one token at T = 1 (its whole law is the draft's `draft_probs`), no
    draft is verified, and the path's next token is committed (the drafter hears every step)."""
    from specdec.core.acceptance import total_variation
    from specdec.loop.decode import DecodeConfig, decode
    from specdec.loop.policy import ProposeOnly
    from specdec.core.shapes import ChainShape

    path = ref["path"] + ref["path"][-1:]  # one step more, so the path's last token is drafted too
    config = DecodeConfig(shape=ProposeOnly(ChainShape(1)), max_new_tokens=len(path), temperature=1.0,
                          stop_on_eos=False, force=[path], cache="dynamic", chat=False)
    out = {"accept": [], "tv": [], "kl": []}
    for event in decode(target, drafter, [prompt], config):
        if event.proposals[0].draft_probs is None:  # the last step: no token left to draft
            continue
        p = event.logits[0, 0].double().log_softmax(-1)
        q = event.proposals[0].draft_probs[0, 0].double().clamp_min(1e-300).log()
        out["accept"].append(float(int(p.argmax()) == int(q.argmax())))
        out["tv"].append(float(total_variation(p.exp(), q.exp())))
        out["kl"].append(float((p.exp() * (p - q)).sum()))
    return out


def measure(target, prompt: list[int], ref: dict, kv: str, depth: int, mal: bool) -> dict:
    """One prompt x one KV spec: mean per-token stats, memory fraction, and (if `mal`) the MAL of a
    greedy chain(depth) generation, checked token-identical to the path."""
    from specdec import generate
    from specdec.drafters import build

    drafter = build("self_draft", target=target, kv=kv, cache="dynamic")
    stats = token_stats(target, drafter, prompt, ref)
    row = {"kv": drafter.policy.spec, **{k: float(np.mean(v)) for k, v in stats.items()},
           "memory_fraction": drafter.policy.retention(drafter.cache.length, drafter.cache.next_position),
           "mal": None}
    if mal:
        out = generate(target, drafter, prompt, shape=f"chain({depth})", max_new_tokens=len(ref["path"]),
                       stop_on_eos=False)
        if out.token_ids != ref["path"]:
            raise AssertionError(f"kv={kv}: chain({depth}) output differs from the target's greedy path")
        row["mal"] = out.stats.mean_acceptance_length
    return row


def curve(target, prompts: list[dict], policies=POLICIES, retentions=RETENTIONS, *, depth: int = 12,
          new_tokens: int = 64, mal_prompts: int = 1, control: bool = True, log=print) -> list[dict]:
    """Rows {prompt, kind, prompt_tokens, policy, retention, kv, accept, tv, kl, memory_fraction, mal}:
    every policy x retention on every prompt, the full cache once per prompt (policy "full"), and with
    `control` a second full-cache drafter (policy "control")."""
    rows = []
    for i, p in enumerate(prompts):
        ref = reference(target, p["tokens"], new_tokens)
        done: dict[str, dict] = {}
        plan = [("full", 1.0), *(("control", 1.0),) * control, *((q, r) for q in policies for r in retentions)]
        for policy, retention in plan:
            kv = policy_spec("full" if policy == "control" else policy, retention, len(p["tokens"]))
            if kv not in done or policy == "control":
                done[kv] = measure(target, p["tokens"], ref, kv, depth, i < mal_prompts)
            row = {"prompt": p["id"], "kind": p["kind"], "prompt_tokens": len(p["tokens"]), "policy": policy,
                   "retention": retention, **done[kv]}
            rows.append(row)
            log(f"  {p['id']} {policy} {retention:.0%} {row['kv']}: accept {row['accept']:.3f} 1-TV "
                f"{1 - row['tv']:.3f} KL {row['kl']:.3g}" + (f" MAL {row['mal']:.2f}" if row["mal"] else ""))
    return rows


# ---- verdict ---------------------------------------------------------------------------------------


def _ratio_ci(ratios: np.ndarray, n_boot: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """Mean of per-prompt ratios with a 95% percentile bootstrap interval over prompts."""
    boot = ratios[rng.integers(0, len(ratios), size=(n_boot, len(ratios)))].mean(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(ratios.mean()), float(lo), float(hi)


def verdict(rows: list[dict], key: str = "accept", n_boot: int = 2000) -> dict:
    """{"points": {policy: [[retention, ratio, lo, hi, within], ...]}, "lowest": {policy: retention or None},
    "control": "within" | "outside" | None}: `key` ("accept", or "tv" read as 1 - TV) per prompt over the
    full cache's on the same prompt."""
    import pandas as pd

    rng = np.random.default_rng(SEED)
    df = pd.DataFrame(rows)
    df["value"] = 1 - df.tv if key == "tv" else df[key]
    full = df[df.policy == "full"].set_index("prompt").value
    if full.empty or (full <= 0).any():
        raise ValueError(f"kv verdict: the full cache's {key} is missing or zero on some prompt ({full.to_dict()})")
    points: dict[str, list] = {}
    for policy, part in df[df.policy != "full"].groupby("policy", sort=False):
        for retention, cell in part.groupby("retention"):
            ratio, lo, hi = _ratio_ci((cell.set_index("prompt").value / full).dropna().to_numpy(float), n_boot, rng)
            points.setdefault(policy, []).append([float(retention), ratio, lo, hi, bool(lo >= 1 - MARGIN)])
    lowest = {}
    for policy, pts in points.items():
        if policy == "control":
            continue
        ok = None
        for retention, *_, within in sorted(pts, reverse=True):
            if not within:
                break
            ok = retention
        lowest[policy] = ok
    control = points.get("control")
    return {"points": points, "lowest": lowest,
            "control": None if control is None else ("within" if all(p[4] for p in control) else "outside")}


# ---- the report's section --------------------------------------------------------------------------


def _pct(retention: float | None) -> str:
    """A verdict's retention; at 100% (for window and snapkv, the full cache itself) no lower one held."""
    if retention is None:
        return "none"
    return f"{100 * retention:g}%" + (" (none lower)" if retention >= 1 else "")


def latest_sweep(root: str | os.PathLike | None = None) -> dict | None:
    """The newest `self_draft` record (scripts/bench_self_draft.py) of this machine, or None."""
    from specdec.measure import records

    try:
        path = Path(root) if root is not None else records.default_root()
        key = records.describe_machine()["key"]
        found = [r for r in records.read(path / f"{key}.jsonl") if r["kind"] == "self_draft"]
    except (OSError, records.RecordError):
        return None
    return found[-1] if found else None  # the file is appended to: the last is the newest


def sweep_lines(record: dict) -> list[str]:
    """Markdown of a full sweep's record: per context and policy, the lowest retention within MARGIN."""
    result = record["result"]
    lines = [f"### Recorded sweep (`{record['command']}`, {record['date']}, {record['machine'].get('name', '?')}, "
             f"commit {record.get('commit')})", "",
             f"{result.get('prompts_per_context', '?')} prompts per context, {result.get('new_tokens')} new tokens, "
             f"chain({result.get('depth')}); per-token greedy acceptance / full cache's, mean [95% CI over prompts].", ""]
    head = ["context", "policy", *(f"{100 * r:g}%" for r in result["retentions"]), "lowest within"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for context, found in result["verdicts"].items():
        for policy, pts in found["points"].items():
            cells = {p[0]: f"{p[1]:.3f} [{p[2]:.3f}, {p[3]:.3f}]" for p in pts}
            lowest = "A/A: " + found["control"] if policy == "control" else _pct(found["lowest"].get(policy))
            lines.append("| " + " | ".join([context, policy, *(cells.get(r, "") for r in result["retentions"]),
                                             lowest]) + " |")
    return [*lines, ""]


def report_parts(results: str | os.PathLike, records_root: str | os.PathLike | None = None,
                 n_boot: int = 2000) -> tuple[list[str], list[str], dict | None]:
    """(markdown lines, verdict lines, JSON summary) of RESULTS/kv_curve.json and the latest full sweep;
    ([], [], None) when neither exists."""
    path = Path(results) / CURVE_FILE
    sweep = latest_sweep(records_root)
    if not path.exists() and sweep is None:
        return [], [], None
    md = ["", "## The KV question: how much cache does a self-drafter need?", ""]
    verdict_lines, summary = [], None
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
        s, rows = data["settings"], data["rows"]
        greedy, sampled = verdict(rows, "accept", n_boot), verdict(rows, "tv", n_boot)
        head = (f"KV retention (self_draft, {s['prompts']} prompts x ~{s['context']} tokens, {s['new_tokens']} "
                f"tokens): lowest retention within {MARGIN:.0%} of the full cache's per-token acceptance")
        verdict_lines = [f"- {head}: " + "; ".join(
            f"{p} {_pct(greedy['lowest'][p])} (sampled, 1 - TV: {_pct(sampled['lowest'][p])})" for p in greedy["lowest"])
            + f"; A/A control (full vs full): {greedy['control']}"]
        md += [f"The `self_draft` drafter (the target's own weights) over a lossy view of the target's KV, on "
               f"{s['prompts']} ledger prompts (retrieval and summary) of ~{s['context']} tokens, {s['new_tokens']} "
               f"greedy tokens; measured in {s['seconds']:.0f} s. Per token along the target's greedy path, the "
               "draft's cache synced with the target's exact K/V after every token: greedy acceptance (argmax "
               "agrees), sampled acceptance at T = 1 (= 1 - TV), KL(target || draft). Ratio = acceptance / the full "
               f"cache's on the same prompt, mean with a 95% bootstrap CI over prompts; **within** when the CI's "
               f"lower end is >= {1 - MARGIN:.2f}. " + (
                   f"MAL: `specdec.generate` with greedy chain({s['depth']}) on the first {s['mal_prompts']} "
                   f"prompt(s) (the full cache reaches {s['depth'] + 1})." if s["mal_prompts"] else
                   "MAL: not measured in this run (`mal_prompts` 0; `grids/full.yaml` and "
                   "`scripts/bench_self_draft.py` measure it)."), "",
               "| policy | retention | kv | memory | greedy acceptance ratio | within | 1 - TV ratio | mean TV | "
               "mean KL | MAL |", "|---|---|---|---|---|---|---|---|---|---|"]
        import pandas as pd

        df = pd.DataFrame(rows)
        for policy, pts in greedy["points"].items():
            for (retention, ratio, lo, hi, within), spt in zip(pts, sampled["points"][policy]):
                cell = df[(df.policy == policy) & (df.retention == retention)]
                mal = f"{cell.mal.dropna().mean():.2f}" if cell.mal.notna().any() else "-"
                md.append(f"| {policy} | {_pct(retention)} | `{cell.kv.iloc[0]}` | {cell.memory_fraction.mean():.3f} | "
                          f"{ratio:.3f} [{lo:.3f}, {hi:.3f}] | {'yes' if within else 'no'} | {spt[1]:.3f} "
                          f"[{spt[2]:.3f}, {spt[3]:.3f}] | {cell.tv.mean():.4f} | {cell.kl.mean():.4f} | "
                          f"{mal} |")
        md += ["", "Lowest retention within, greedy / sampled: " + "; ".join(
            f"{p} {_pct(greedy['lowest'][p])} / {_pct(sampled['lowest'][p])}" for p in greedy["lowest"])
            + f". A/A control: **{greedy['control']}**.", ""]
        summary = {"greedy": greedy["lowest"], "sampled": sampled["lowest"], "control": greedy["control"],
                   "prompts": s["prompts"], "context": s["context"], "seconds": round(s["seconds"], 1)}
    if sweep is not None:
        md += sweep_lines(sweep)
        summary = {**(summary or {}), "sweep": {"date": sweep["date"], "verdicts": {
            c: v["lowest"] for c, v in sweep["result"]["verdicts"].items()}}}
    return md, verdict_lines, summary


# ---- the command -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The reduced KV-retention curve: writes RESULTS/kv_curve.json.")
    ap.add_argument("results", help="the results directory (the report reads RESULTS/kv_curve.json)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens at most (chat template included)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=12, help="chain depth of the MAL runs")
    ap.add_argument("--mal-prompts", type=int, default=1, help="prompts whose MAL is measured by generation")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--retentions", default=",".join(f"{100 * r:g}" for r in RETENTIONS), help="percent")
    args = ap.parse_args(argv)
    import specdec
    from experiments.leaderboard import atomic_text

    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        target = specdec.load_target(args.model)
        prompts = long_prompts(target, args.prompts, args.context)
        print(f"kv curve: {len(prompts)} prompts of {[len(p['tokens']) for p in prompts]} tokens", flush=True)
        rows = curve(target, prompts, [p for p in args.policies.split(",") if p],
                     [float(r) / 100 for r in args.retentions.split(",")], depth=args.depth,
                     new_tokens=args.new_tokens, mal_prompts=args.mal_prompts,
                     log=lambda line: print(line, flush=True))
    except ValueError as err:
        print(f"experiments.kv: error: {err}", file=sys.stderr)
        return 2
    settings = {"model": target.label, "prompts": len(prompts), "context": args.context,
                "new_tokens": args.new_tokens, "depth": args.depth, "mal_prompts": min(args.mal_prompts, len(prompts)),
                "seconds": time.perf_counter() - started, "threads": torch.get_num_threads()}
    path = Path(args.results) / CURVE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_text(path, json.dumps({"settings": settings, "rows": rows}, indent=1))
    print(f"kv curve: wrote {path} in {settings['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
