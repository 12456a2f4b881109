#!/usr/bin/env bash
# The CPU checks for a machine this project's development machines are not: the CPU kernels'
# tests (AMX ones run only where the CPU has AMX) and `modserve bench roofline` at 1 and 64
# clients, pinned to CORES cores, on random SmolLM2-shaped bfloat16 weights (speed does not
# depend on the values; no download). Written for the host CPU of a lent GPU machine, which
# may have AMX where no development machine does (docs/benchmark-results.md, "AMX host").
#
#   scripts/host-cpu-check.sh            # from a checkout, with modserve importable by $PYTHON
#
# Env (defaults): PYTHON (python3; .venv/bin/python where it exists), CORES (2), OUT
# (benchmarks/results/host-cpu-<time>, ignored by git), CONFIGS ("graphs parts": the roofline
# runs with decode call lists, then without), PYTEST_ARGS (none; e.g. "-n 8" where pytest-xdist
# is installed and the host has the cores: the tests are not pinned). The tests and benchmarks run from a
# copy outside the checkout, so that an installed modserve (a wheel) is not shadowed by the
# checkout's modserve/ folder. Raw output goes to OUT; the summary to stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo "$ROOT/.venv/bin/python" || echo python3)}
CORES=${CORES:-2}
OUT=${OUT:-$ROOT/benchmarks/results/host-cpu-$(date +%Y%m%d-%H%M%S)}
CONFIGS=${CONFIGS:-graphs parts}
[[ "$CORES" =~ ^[1-9][0-9]*$ ]] || { echo "CORES: expected a whole number >= 1, got '$CORES'" >&2; exit 2; }
for cfg in $CONFIGS; do
  [[ "$cfg" == graphs || "$cfg" == parts ]] || { echo "CONFIGS: expected graphs and/or parts, got '$cfg'" >&2; exit 2; }
done
mkdir -p "$OUT"
{
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core\(s\)|Socket|L2|L3"
  echo "flags: $(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx|amx|fma|vnni|bf16|fp16' | tr '\n' ' ')"
  echo "compiler: $(command -v "${CXX:-g++}" || echo none)"
  "$PYTHON" -c "import sys, torch, modserve; print('python', sys.version.split()[0], 'torch', torch.__version__)"
} | tee "$OUT/cpu.txt"
command -v "${CXX:-g++}" >/dev/null || { echo "no C++ compiler: the CPU kernels cannot build here" >&2; exit 1; }
# CORES CPUs on distinct physical cores of socket 0 (SMT siblings would share one core's units)
CPUS=$(lscpu -p=CPU,CORE,SOCKET | grep -v '^#' | awk -F, '$3 == 0 && !seen[$2]++ {print $1}' | head -n "$CORES" | paste -sd,)
[ "$(echo "$CPUS" | tr ',' '\n' | wc -l)" -eq "$CORES" ] || { echo "CORES=$CORES: socket 0 has fewer physical cores" >&2; exit 2; }
echo "pinned to CPUs $CPUS"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp -r tests benchmarks "$WORK/"
cd "$WORK"

echo "== CPU kernels built"
"$PYTHON" -m modserve.native.build > "$OUT/build.txt" 2>&1
tail -n 2 "$OUT/build.txt"

echo "== CPU kernel tests"
# -v names each test as it ends, so that a run cut short (a lent machine's minutes) still says
# which failed or errored; -rfEs lists them again, with the reason, at the end
# shellcheck disable=SC2086
timeout 600 "$PYTHON" -m pytest -v -p no:cacheprovider -rfEs ${PYTEST_ARGS:-} tests/test_cpu_amx_linear.py \
  tests/test_cpu_amx_prefill.py tests/test_cpu_attention.py tests/test_cpu_panel_linear.py tests/test_cpu_linear.py \
  tests/test_cpu_avx2_linear.py tests/test_cpu_decode_graphs.py tests/test_cpu_int8_panel_linear.py \
  tests/test_cpu_group_int8_panels.py tests/test_cpu_int4_panels.py tests/test_cpu_experts.py \
  tests/test_cpu_int8_experts.py tests/test_cpu_fused.py > "$OUT/tests.txt" 2>&1
echo "rc $?" >> "$OUT/tests.txt"
tail -n 2 "$OUT/tests.txt"
named=$(grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | head -n 20)  # the summary's, with reasons
[ -n "$named" ] || named=$(grep -E "FAILED|ERROR" "$OUT/tests.txt" | grep "::" | head -n 20)  # cut short: as they ended
[ -z "$named" ] || echo "$named"

echo "== random SmolLM2-shaped checkpoint"
"$PYTHON" - "$WORK/smollm2-random" "$OUT" <<'EOF' || exit 1
import os, sys
import yaml
sys.path.insert(0, "benchmarks")
import gpu_throughput as g
path, out = sys.argv[1], sys.argv[2]
os.makedirs(path, exist_ok=True)
g.build_checkpoint(g.SHAPES["smollm2"], path, "cpu")
for name, device in (("graphs", "cpu"), ("parts", {"plugin": "cpu", "decode_graphs": False})):
    cfg = {"model": {"path": path, "dtype": "bfloat16", "max_model_len": 2048}, "device": device,
           "scheduler": {"plugin": "fcfs", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
           "kv_cache": {"plugin": "paged", "block_size": 16, "memory_gb": 4.0, "prefix_caching": True},
           "attention": {"plugin": "auto"}, "observers": []}
    with open(os.path.join(out, f"pipeline-{name}.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
EOF

# call lists on (as served), then off (every part of the forward timed)
for cfg in $CONFIGS; do
  for c in "1 4" "64 128"; do
    set -- $c
    echo "== bench roofline, $1 client(s), $cfg"
    timeout 300 taskset -c "$CPUS" env OMP_NUM_THREADS="$CORES" "$PYTHON" -m modserve.cli bench roofline \
      -c "$OUT/pipeline-$cfg.yaml" --dtypes bfloat16 --input-len 256 --output-len 128 --range-ratio 0.5 \
      --concurrency "$1" --num-prompts "$2" --output "$OUT/roofline-$cfg-$1.json" > "$OUT/roofline-$cfg-$1.txt" 2>&1
    echo "rc $?" >> "$OUT/roofline-$cfg-$1.txt"
    grep -E "^Chose|^Memory|wall [0-9]|% of the measured read|linears \(|attention backend|rest \(|^rc" "$OUT/roofline-$cfg-$1.txt"
  done
done
echo "raw output: $OUT"
