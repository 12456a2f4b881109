#!/usr/bin/env bash
# The test command the README names: the whole suite, quiet, with the slowest tests listed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
