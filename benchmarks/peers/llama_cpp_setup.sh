#!/usr/bin/env bash
# llama.cpp's llama-server built from source (optional peer). The source comes from PyPI: the
# llama-cpp-python sdist vendors the whole llama.cpp tree (no git clone needed). Also writes a
# bf16 GGUF of the same HF directory the other systems serve, with llama.cpp's own converter, and
# with QUANTS (e.g. "Q4_K_M Q8_0") llama-quantize's files of it beside it, the bf16 file's name with <type> for bf16:
# smollm2-135m-instruct-<type>.gguf. Another model: MODEL_DIR=<HF dir> LLAMA_GGUF=<dir>/<name>-bf16.gguf.
#
#   benchmarks/peers/llama_cpp_setup.sh     # LLAMA_CPP_DIR=/tmp/llama-cpp MODEL_DIR=/tmp/smollm2-135m-instruct-hf QUANTS=""
# Needs cmake and a C++ compiler (apt-get install cmake g++ if missing).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
DIR=${LLAMA_CPP_DIR:-/tmp/llama-cpp}
MODEL_DIR=${MODEL_DIR:-/tmp/smollm2-135m-instruct-hf}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
GGUF=${LLAMA_GGUF:-$DIR/smollm2-135m-instruct-bf16.gguf}
PY=$(modserve_python)

t0=$(now)
mkdir -p "$DIR"
if [ ! -x "$DIR/build/bin/llama-server" ]; then
    if ! ls -d "$DIR"/llama_cpp_python-*/vendor/llama.cpp >/dev/null 2>&1; then
        "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/sdist"
        tar xzf "$DIR"/sdist/llama_cpp_python-*.tar.gz -C "$DIR"
    fi
    SRC=$(ls -d "$DIR"/llama_cpp_python-*/vendor/llama.cpp | head -1)
    cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
    cmake --build "$DIR/build" --target llama-server -j "$(nproc)" >/dev/null
else
    echo "llama-server: already built in $DIR/build"
fi
echo "llama.cpp build took $(since "$t0") s ($DIR/build/bin/llama-server)"

if [ ! -f "$GGUF" ]; then
    t1=$(now)
    [ -f "$MODEL_DIR/config.json" ] || "$PY" "$HERE/../convert_smollm2_to_hf.py" "$MODEL_DIR"
    SRC=$(ls -d "$DIR"/llama_cpp_python-*/vendor/llama.cpp | head -1)
    # the converter imports sentencepiece before it finds there is no tokenizer.model; kept
    # beside the build rather than in modserve's environment
    "$PY" -m pip install --quiet --target "$DIR/converter-deps" sentencepiece
    PYTHONPATH="$DIR/converter-deps" "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" --outtype bf16 --outfile "$GGUF" >/dev/null
    echo "bf16 GGUF conversion took $(since "$t1") s ($GGUF)"
fi

for quant in ${QUANTS:-}; do
    out="${GGUF%-bf16.gguf}"; out="${out%.gguf}-$quant.gguf"   # beside the bf16 file: <name>-Q4_K_M.gguf
    [ -f "$out" ] && continue
    [ -x "$DIR/build/bin/llama-quantize" ] || cmake --build "$DIR/build" --target llama-quantize -j "$(nproc)" >/dev/null
    "$DIR/build/bin/llama-quantize" "$GGUF" "$out" "$quant" >/dev/null
    echo "llama-quantize: $out"
done
