# shellcheck shell=bash
# Helpers shared by benchmarks/compare.sh and the peer scripts: timing, waiting for a server,
# pinning to CPUs. Sourced, not run.

now() { date +%s.%N; }

# seconds since a `now` value, e.g. `t0=$(now); ...; echo "took $(since "$t0") s"`
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f", b - a }'; }

# the Python that runs modserve (the repo's .venv if there is one)
modserve_python() {
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    if [ -n "${PY:-}" ]; then echo "$PY"
    elif [ -x "$root/.venv/bin/python" ]; then echo "$root/.venv/bin/python"
    else command -v python3; fi
}

# wait_ready URL [TIMEOUT_S] [PID]: until GET URL answers 200; fails early if PID exits
wait_ready() {
    local url=$1 timeout=${2:-600} pid=${3:-} t0
    t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$timeout" ]; do
        if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
            echo "server (pid $pid) exited before $url answered" >&2
            return 1
        fi
        if curl -sf -o /dev/null --max-time 2 "$url"; then return 0; fi
        sleep 1
    done
    echo "no answer from $url after ${timeout}s" >&2
    return 1
}

# default CPU split: with 4+ CPUs the client gets the last one and the server the rest; with
# fewer, pinning would take a whole core from the server, so nothing is pinned (override with
# SERVER_CPUS / CLIENT_CPUS, e.g. SERVER_CPUS=0-1 CLIENT_CPUS=1)
default_cpus() {
    local n
    n=$(nproc)
    ALL_CPUS="0-$((n - 1))"
    if [ "$n" -ge 4 ]; then
        SERVER_CPUS=${SERVER_CPUS-0-$((n - 2))}
        CLIENT_CPUS=${CLIENT_CPUS-$((n - 1))}
    else
        SERVER_CPUS=${SERVER_CPUS-}
        CLIENT_CPUS=${CLIENT_CPUS-}
    fi
}

# pin CPUS CMD...: run CMD under taskset when CPUS is set (in the foreground: `pin ... &` would
# give the pid of a subshell, not of CMD)
pin() {
    local cpus=$1
    shift
    if [ -n "$cpus" ]; then taskset -c "$cpus" "$@"; else "$@"; fi
}
