"""Plain autoregressive decoding: specdec's loop (drafter `none`) against Hugging Face `generate`.

Same target, prompts, lengths and greedy decoding; runs interleaved (ours, HF, ours, HF, ...) so
machine noise hits both alike. Prints a human-readable card, then one JSON line with the ratio
(ours tokens/s / HF tokens/s; > 1 means ours is faster). Not a test: a measurement.

    python scripts/bench_decode.py [--model smollm2-135m] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import specdec

PROMPTS = [
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = specdec.load_target(args.model)

    def ours(prompt_ids):
        out = specdec.generate(target, None, prompt_ids, max_new_tokens=args.new_tokens, stop_on_eos=False)
        return out.token_ids

    def hf(prompt_ids):
        ids = torch.tensor([prompt_ids])
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                    min_new_tokens=args.new_tokens, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    runners = {"specdec": ours, "hf_generate": hf}
    prompt_ids = [target.encode_prompt(p) for p in PROMPTS]
    for ids in prompt_ids[:1]:  # warm-up, not timed
        for run in runners.values():
            run(ids)
    times = {name: [] for name in runners}
    tokens = {name: 0 for name in runners}
    agree = 0
    for _ in range(args.repeats):
        for ids in prompt_ids:
            outs = {}
            for name, run in runners.items():
                t0 = time.perf_counter()
                outs[name] = run(ids)
                times[name].append(time.perf_counter() - t0)
                tokens[name] += len(outs[name])
            agree += outs["specdec"] == outs["hf_generate"]
    tps = {name: tokens[name] / sum(times[name]) for name in runners}
    ratio = tps["specdec"] / tps["hf_generate"]
    runs = args.repeats * len(PROMPTS)
    print(f"== plain decoding: specdec loop vs HF generate ({target.name}, greedy, {args.new_tokens} new tokens)")
    print(f"   machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {runs} interleaved runs per side")
    for name in runners:
        print(f"   {name:12s} {tps[name]:7.2f} tok/s   median run {statistics.median(times[name]):.2f} s")
    print(f"   ratio specdec / HF: {ratio:.3f}x   identical outputs: {agree}/{runs}")
    print(json.dumps({"bench": "decode", "model": target.name, "new_tokens": args.new_tokens, "runs": runs,
                      "specdec_tok_s": tps["specdec"], "hf_tok_s": tps["hf_generate"], "ratio": ratio,
                      "identical": agree}))


if __name__ == "__main__":
    main()
