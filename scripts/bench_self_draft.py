"""How far can KV compression go before it stops being free? The self-draft acceptance curve.

    python scripts/bench_self_draft.py                                   # the full sweep (hours on a CPU)
    python scripts/bench_self_draft.py --contexts 2k --retentions 5,25,100 --new-tokens 32   # reduced
    python scripts/bench_self_draft.py --model tiny-llama --contexts 2k --retentions 25 --new-tokens 8 \\
        --shapes "chain(2)" --max-prompt 200                                # smoke

On the long prompt suite (`experiments/prompts/long.jsonl`, one question per context length), for
each KV policy at each retention (the fraction of the prompt's positions the draft keeps) and each
weights spec of the draft: greedy `self_draft` generation under each shape, giving the mean
acceptance length (MAL, bonus included) and mean accepted tokens per round (bonus excluded), draft
and verify seconds per step; and, along the greedy path, the mean KL(full || lossy) of the
next-token distributions (the target's own vs the self-draft's over its lossy cache, synced with
the target's exact K/V after every token as in generation) and their top-1 agreement.

Retention r over a prompt of P tokens: `window` keeps sink 4 + recent rP - 4; `snapkv` a budget of
rP (window min(32, rP)); `quant(b)` a window of rP positions of b-bit entries (at r = 100%: every
position quantized), so its memory fraction is r * (b + 32/G) / 16, also reported. r = 100% of
`window` and `snapkv` is the full cache. Prints a human card, saves a PNG of MAL and KL against
retention per policy and context, and prints one JSON object as the very last line.
Timing figures are only comparable within one run; wrap timing runs in
`flock /tmp/specdec-timing.lock`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import specdec
from specdec.target.cache import KVCache
from specdec.core.draft import Acceptance, Draft, Step
from specdec.drafters import build
from specdec.core.loop import prefill

SUITE = Path(__file__).resolve().parents[1] / "experiments" / "prompts" / "long.jsonl"
POLICIES = ("window", "snapkv", "quant4", "quant8")


def policy_spec(policy: str, retention: float, prompt_tokens: int) -> str:
    """The `kv=` spec of `policy` keeping `retention` of a prompt of `prompt_tokens` positions."""
    keep = max(8, round(retention * prompt_tokens))
    if policy.startswith("quant"):
        bits = int(policy[len("quant"):])
        return f"quant(bits={bits})" if retention >= 1 else f"window(sink=4,recent={keep - 4})+quant(bits={bits})"
    if retention >= 1:
        return "full"
    if policy == "window":
        return f"window(sink=4,recent={keep - 4})"
    if policy == "snapkv":
        return f"snapkv(budget={keep},window={min(32, keep)})"
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def path_reference(target, prompt: list[int], path: list[int]) -> tuple[Step, torch.Tensor, list]:
    """Once per prompt: the prefill step (its cache kept alive in the closure), the target's logits
    [1, N, V] along the greedy `path`, and the target's exact K/V of the path's rows."""
    cache = KVCache()
    start = prefill(target, cache, prompt)
    full = target.forward(torch.tensor([[prompt[-1], *path[:-1]]]), cache).logits.double()  # [1, N, V]
    exact = [(k.clone(), v.clone()) for k, v in cache.tail(len(path))]  # the path rows' K/V
    cache.truncate(len(prompt) - 1)
    return start, full, exact


def greedy_path_kl(target, drafter, prompt: list[int], path: list[int], reference) -> tuple[float, float]:
    """Mean KL(target || self-draft) of next-token distributions and top-1 agreement along `path`
    (the greedy continuation of `prompt`), the draft's cache synced with the target's exact K/V
    after every token, as in generation."""
    start, full, exact = reference
    drafter.reset()
    drafter.commit(start)
    kls, agree = [], []
    tokens = [*prompt]
    for t, token in enumerate(path):
        logits = drafter.model.forward(torch.tensor([[tokens[-1]]]), drafter.cache).logits[0, -1].double()
        p, q = full[0, t].log_softmax(-1), logits.log_softmax(-1)
        kls.append(float((p.exp() * (p - q)).sum()))
        agree.append(int(full[0, t].argmax()) == int(logits.argmax()))
        tokens.append(token)
        row = [(k[..., t:t + 1, :], v[..., t:t + 1, :]) for k, v in exact]
        drafter.commit(Step(
            token_ids=torch.tensor([tokens]), num_new=[1], draft=Draft.empty(),
            acceptances=[Acceptance(path=[], next_token=token, bonus=False)],
            positions=torch.tensor([[len(tokens) - 2]]), target_hidden=torch.empty(1, 1, target.hidden_size),
            _kv=lambda row=row: row,
        ))
    return sum(kls) / len(kls), sum(agree) / len(agree)


def measure(target, prompt, plain, reference, kv, weights, shapes, new_tokens) -> dict:
    drafter = build("self_draft", target=target, kv=kv, weights=weights)
    kl, top1 = greedy_path_kl(target, drafter, prompt, plain, reference)
    row = {"kv": drafter.policy.spec, "weights": weights, "kl": kl, "top1": top1,
           "memory_fraction": None, "shapes": {}}
    for shape in shapes:
        out = specdec.generate(target, drafter, prompt, shape=shape, max_new_tokens=new_tokens, stop_on_eos=False)
        if out.token_ids != plain:
            raise AssertionError(f"kv={kv} weights={weights} {shape}: output differs from plain greedy")
        steps = out.stats.steps
        row["shapes"][shape] = {
            "mal": out.stats.mean_acceptance_length,
            "mean_accepted": out.stats.mean_acceptance_length - 1,
            "steps": len(steps),
            "draft_s_per_step": sum(s.draft_time_s for s in steps) / len(steps),
            "verify_s_per_step": sum(s.verify_time_s for s in steps) / len(steps),
        }
    positions = drafter.cache.next_position
    row["memory_fraction"] = drafter.policy.retention(drafter.cache.length, positions)
    return row


def plot(rows: list[dict], shapes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = sorted({r["policy"] for r in rows}, key=list(POLICIES).index)
    fig, axes = plt.subplots(2, len(policies), figsize=(3.2 * len(policies), 5.6), squeeze=False, sharey="row")
    for j, policy in enumerate(policies):
        for key in sorted({(r["context"], r["weights"]) for r in rows if r["policy"] == policy}):
            sel = sorted((r for r in rows if r["policy"] == policy and (r["context"], r["weights"]) == key),
                         key=lambda r: r["retention"])
            x = [100 * r["retention"] for r in sel]
            label = f"{key[0]}" + ("" if key[1] == "none" else f" w={key[1]}")
            for shape, style in zip(shapes, ("-o", "--s", ":^")):
                axes[0, j].plot(x, [r["shapes"][shape]["mal"] for r in sel], style, label=f"{label} {shape}")
            axes[1, j].plot(x, [max(r["kl"], 1e-6) for r in sel], "-o", label=label)
        axes[0, j].set_title(policy)
        axes[1, j].set_xlabel("KV retention (% of prompt positions)")
        for ax in axes[:, j]:
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
        axes[1, j].set_yscale("log")
    axes[0, 0].set_ylabel("MAL (bonus included)")
    axes[1, 0].set_ylabel("mean KL(full || lossy)")
    axes[0, -1].legend(fontsize=6)
    axes[1, -1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2k,4k,7k", help="question ids long-<context>-<kind> of the suite")
    ap.add_argument("--kind", default="retrieval", help="retrieval | summary")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--retentions", default="5,10,25,50,100", help="percent of prompt positions kept")
    ap.add_argument("--weights", default="none,torchao_int4", help="quant specs of the draft's weights")
    ap.add_argument("--shapes", default="chain(8);dynamic(top_k=4,depth=8,budget=24)", help="';'-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=0, help="cut prompts to this many tokens (0 = as is)")
    ap.add_argument("--png", default="self_draft_curve.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    target = specdec.load_target(args.model)
    suite = {json.loads(line)["question_id"]: json.loads(line) for line in SUITE.read_text().splitlines() if line}
    shapes = [s for s in args.shapes.split(";") if s]
    retentions = [float(r) / 100 for r in args.retentions.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    rows, started = [], time.perf_counter()
    for context in args.contexts.split(","):
        prompt = target.encode_prompt(suite[f"long-{context}-{args.kind}"]["turns"][0])
        if args.max_prompt:
            prompt = prompt[-args.max_prompt:]
        t0 = time.perf_counter()
        plain = specdec.generate(target, None, prompt, max_new_tokens=args.new_tokens, stop_on_eos=False)
        plain_s_per_token = (time.perf_counter() - t0 - plain.stats.prefill_time_s) / args.new_tokens
        reference = path_reference(target, prompt, plain.token_ids)
        done: dict[tuple[str, str], dict] = {}
        for weights in [w for w in args.weights.split(",") if w]:
            for policy in policies:
                for retention in retentions:
                    kv = policy_spec(policy, retention, len(prompt))
                    if (kv, weights) not in done:
                        done[kv, weights] = measure(target, prompt, plain.token_ids, reference, kv, weights,
                                                    shapes, args.new_tokens)
                    row = {"context": context, "prompt_tokens": len(prompt), "policy": policy,
                           "retention": retention, "plain_s_per_token": plain_s_per_token, **done[kv, weights]}
                    rows.append(row)
                    cells = " | ".join(f"{s['mal']:.2f} ({1e3 * s['draft_s_per_step']:.0f}/"
                                       f"{1e3 * s['verify_s_per_step']:.0f} ms)" for s in row["shapes"].values())
                    print(f"| {context} ({len(prompt)}) | {weights} | {row['kv']} | {100 * retention:.0f}% | "
                          f"{row['memory_fraction']:.3f} | {row['kl']:.3g} | {row['top1']:.2f} | {cells} |",
                          flush=True)
    png = Path(args.png)
    plot(rows, shapes, png)
    summary = {"bench": "self_draft", "model": target.label, "kind": args.kind, "shapes": shapes,
               "new_tokens": args.new_tokens, "cpu": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "seconds": time.perf_counter() - started, "png": str(png),
               "rows": rows}
    print(f"columns: context | weights | kv | retention | memory fraction | KL | top-1 | per shape "
          f"{shapes}: MAL (draft/verify ms per step); PNG: {png}", file=sys.stderr)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
