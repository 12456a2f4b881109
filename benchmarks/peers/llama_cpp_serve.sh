#!/usr/bin/env bash
# Serve a GGUF with llama-server (continuous batching, PARALLEL slots) on 127.0.0.1:PORT, in the foreground.
#
#   benchmarks/peers/llama_cpp_serve.sh [GGUF] [PORT] [extra llama-server args...]
# Env: LLAMA_CPP_DIR (/tmp/llama-cpp), PARALLEL (64 slots), CTX_PER_SLOT (1024 tokens),
#      THREADS (default: every CPU the server may use)
set -euo pipefail
DIR=${LLAMA_CPP_DIR:-/tmp/llama-cpp}
GGUF=${1:-$DIR/smollm2-135m-instruct-bf16.gguf}
PORT=${2:-8012}
shift $(( $# >= 2 ? 2 : $# ))
if [ ! -x "$DIR/build/bin/llama-server" ]; then
    echo "llama-server is not built: run benchmarks/peers/llama_cpp_setup.sh" >&2
    exit 1
fi
PARALLEL=${PARALLEL:-64}
exec "$DIR/build/bin/llama-server" -m "$GGUF" --host 127.0.0.1 --port "$PORT" \
    --parallel "$PARALLEL" --ctx-size $(( PARALLEL * ${CTX_PER_SLOT:-1024} )) --cont-batching \
    --threads "${THREADS:-$(nproc)}" --no-webui "$@"
