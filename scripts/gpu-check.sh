#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): the engine's parity checks on CUDA with the Triton
# kernels compiled, INT8 KV, prefix caching, preemption and speculative decoding, and a short
# report. `--device cpu` is the CPU mode CI runs (what needs CUDA is reported as skipped).
# Needs the test extras (transformers is the oracle): bash scripts/setup.sh, or any environment
# with modserve, torch, triton and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PYTHON" scripts/gpu_check.py "$@"
