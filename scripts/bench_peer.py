"""specdec against a CPU peer: llama.cpp's greedy decode of the same GGUF file, one thread, interleaved.

    pip install -e '.[peer]'      # llama-cpp-python: builds llama.cpp from source (about 20 minutes)
    python scripts/bench_peer.py [--prompts 6] [--tokens 64] [--drafter eagle] [--shape auto] [--quant SPEC]

Per prompt, after an untimed warm-up, in an order rotated each prompt: llama.cpp greedy, specdec's plain loop,
specdec with `--drafter` at `--shape`. Prints tokens/s per engine, ratios to llama.cpp (mean, 95% interval over
prompts), one JSON line; without llama-cpp-python, exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

if importlib.util.find_spec("llama_cpp") is None:
    print("bench_peer: llama-cpp-python is not installed (pip install -e '.[peer]'); nothing to compare")
    sys.exit(0)

import llama_cpp  # noqa: E402
import torch  # noqa: E402

import specdec  # noqa: E402
from experiments.decode_speed import load_prompts  # noqa: E402
from specdec.loading import embedded_gguf_path  # noqa: E402
from specdec.machine import machine_name  # noqa: E402
from specdec.measure.width_effect import mean_ci  # noqa: E402
from specdec.tune import ensure_tuned  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_peer.py", description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--drafter", default="eagle")
    parser.add_argument("--shape", default="auto")
    parser.add_argument("--quant", default=None, help="specdec's target quantized, e.g. torchao_int4_g32 (tuned first)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    peer = llama_cpp.Llama(str(embedded_gguf_path()), n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)
    ensure_tuned("smollm2-135m", 1, quant=args.quant)
    target = specdec.load_target("smollm2-135m", threads=1, quant=args.quant)
    drafter = specdec.drafters.build(args.drafter, target=target)
    rates: dict[str, list[float]] = {"llama.cpp": [], "plain": [], f"{args.drafter} {args.shape}": []}

    def run(engine: str, ids: list[int]) -> int:
        if engine != "llama.cpp":
            return len(specdec.generate(target, None if engine == "plain" else drafter, ids, shape=args.shape,
                                        max_new_tokens=args.tokens, stop_on_eos=False).token_ids)
        peer.reset()  # else generate() skips the prefix it still holds from the last call: no prefill paid
        made = 0
        for _ in peer.generate(ids, top_k=1, temp=0.0, reset=True):
            made += 1
            if made == args.tokens:
                return made
        return made

    engines = list(rates)
    for i, text in enumerate(load_prompts("chat_heldout", args.prompts)):
        ids = target.encode_prompt(text)  # the chat template's token ids, fed to both engines
        if i == 0:  # untimed warm-up: llama.cpp's first call pages its mapped file in, auto measures its curve
            for engine in engines:
                run(engine, ids)
        for engine in engines[i % 3:] + engines[:i % 3]:  # interleaved, the order rotated by one each prompt
            t0 = time.perf_counter()
            made = run(engine, ids)
            rates[engine].append(made / (time.perf_counter() - t0))
    ratios = {}
    for engine, values in rates.items():
        mean, lo, hi = mean_ci([v / p for v, p in zip(values, rates["llama.cpp"])])
        ratios[engine] = [round(mean, 3), round(lo, 3), round(hi, 3)]
        print(f"{engine:>24}: {sum(values) / len(values):6.1f} tok/s   x llama.cpp {mean:.2f} [{lo:.2f}, {hi:.2f}]")
    print(json.dumps({"bench": "peer", "machine": machine_name(), "threads": 1, "tokens": args.tokens, "quant": args.quant,
                      "prompts": len(rates["plain"]), "tok_s": {e: sum(v) / len(v) for e, v in rates.items()},
                      "ratio_to_llama_cpp": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
