#!/usr/bin/env bash
# The optional `speculators` package (vLLM's EAGLE-3 checkpoint format) beside specdec's CPU torch.
# `pip install speculators` would replace torch with a CUDA build and bring a torchvision that does not
# match the CPU torch (transformers then fails to import: "operator torchvision::nms does not exist").
# So: its light dependencies through the extra, speculators and hs-connectors without theirs, and a check.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -e ".[speculators]"
python -m pip install --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
python - <<'PY'
import importlib.util, sys
for bad in ("torchvision", "torchaudio"):
    if importlib.util.find_spec(bad):
        sys.exit(f"{bad} is installed and may not match the CPU torch: pip uninstall {bad}")
import torch
from transformers import LlamaConfig  # noqa: F401  (fails when a mismatched torchvision slipped in)
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
print(f"speculators ready beside torch {torch.__version__}")
PY
