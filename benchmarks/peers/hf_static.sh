#!/usr/bin/env bash
# HF transformers static batching (offline), next to modserve offline on the same requests:
# `modserve bench throughput --baseline hf`. Prints both and their ratios.
#
#   benchmarks/peers/hf_static.sh CONFIG [OUT.json]
# Env: HF_BATCH (16), MODSERVE_SEQS (16,64: modserve's max_num_seqs, each against HF's batch),
# HF_NUM_PROMPTS (64), INPUT_LEN (256), OUTPUT_LEN (128), RANGE_RATIO (0.5: lengths vary by
# +-50%, as in compare.sh's online runs), REPEATS (1: rounds, modserve and HF alternating), DTYPE
# (bfloat16), SERVER_CPUS
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
CONFIG=${1:?usage: hf_static.sh CONFIG [OUT.json]}
OUT=${2:-/tmp/modserve-offline.json}
PY=$(modserve_python)
default_cpus

t0=$(now)
# HF's side runs in modserve's own venv: transformers and accelerate (modserve[test]) are all it needs
if ! "$PY" -c "import transformers, accelerate" 2>/dev/null; then
    "$PY" -m pip install --quiet "transformers>=4.56" "accelerate>=1.0"
fi
echo "hf setup took $(since "$t0") s (transformers $("$PY" -c 'import transformers; print(transformers.__version__)') in $(dirname "$(dirname "$PY")"))"

pin "$SERVER_CPUS" "$PY" -m modserve.cli bench throughput -c "$CONFIG" --dtype "${DTYPE:-bfloat16}" \
    --max-num-seqs "${MODSERVE_SEQS:-16,64}" --hf-batch-size "${HF_BATCH:-16}" --num-prompts "${HF_NUM_PROMPTS:-64}" \
    --input-len "${INPUT_LEN:-256}" --output-len "${OUTPUT_LEN:-128}" --range-ratio "${RANGE_RATIO:-0.5}" \
    --repeats "${REPEATS:-1}" --baseline hf --output "$OUT"
