#!/usr/bin/env bash
# A Ray cluster of a head and one worker node on 127.0.0.1 (one CPU each), two SmolLM2 engine
# replicas deployed on it, a bounded load through the OpenAI API with one replica killed
# mid-run, then everything torn down. Exit 0 when every request was answered or failed
# cleanly, the replica was replaced and the application kept serving.
#
#   PYTHON=.venv/bin/python bash examples/deploy/ray/smoke.sh
#
# Needs modserve with the `ray` extra in $PYTHON's environment. Every port is picked free at
# start; only the processes this script started are stopped (by their pids).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3}"
BIN="$(dirname "$(command -v "$PYTHON")")"
RAY="$BIN/ray"
WORK="$(mktemp -d /tmp/modserve-ray-XXXXXX)"
PIDS=()

free_ports() {  # N free TCP ports on 127.0.0.1
  "$PYTHON" - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

cleanup() {
  local code=$?
  if [ -n "${DEPLOYED:-}" ]; then  # stop Serve first: a node with live replicas drains for 30 s on SIGTERM
    timeout 60 "$PYTHON" -c "import sys, ray; from ray import serve; ray.init(address=sys.argv[1], \
logging_level='ERROR', log_to_driver=False); serve.shutdown()" "127.0.0.1:$GCS" >/dev/null 2>&1 || true
  fi
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  if [ "$code" -ne 0 ]; then tail -n 25 "$WORK"/head.log "$WORK"/worker.log "$WORK"/deploy.log >&2 2>/dev/null || true; fi
  if [ -z "${KEEP_WORK:-}" ]; then rm -rf "$WORK"; else echo "smoke: logs kept in $WORK" >&2; fi
  exit "$code"
}
trap cleanup EXIT

read -r GCS CLIENT HTTP H1 H2 H3 H4 H5 H6 W1 W2 W3 W4 W5 W6 <<<"$(free_ports 15)"
node_ports() {  # the ports a node would otherwise take at fixed defaults
  echo "--node-manager-port=$1 --object-manager-port=$2 --dashboard-agent-listen-port=$3 \
--dashboard-agent-grpc-port=$4 --runtime-env-agent-port=$5 --metrics-export-port=$6"
}
COMMON="--node-ip-address=127.0.0.1 --num-cpus=1 --object-store-memory=200000000 --disable-usage-stats --block"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0

# shellcheck disable=SC2046,SC2086
"$RAY" start --head --port="$GCS" --ray-client-server-port="$CLIENT" --include-dashboard=false \
  --temp-dir="$WORK/ray" $COMMON $(node_ports $H1 $H2 $H3 $H4 $H5 $H6) >"$WORK/head.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 60); do "$RAY" status --address="127.0.0.1:$GCS" >/dev/null 2>&1 && break; sleep 1; done
# shellcheck disable=SC2046,SC2086
"$RAY" start --address="127.0.0.1:$GCS" $COMMON $(node_ports $W1 $W2 $W3 $W4 $W5 $W6) >"$WORK/worker.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 60); do
  [ "$("$RAY" status --address="127.0.0.1:$GCS" 2>/dev/null | grep -c 'node_')" -ge 2 ] && break; sleep 1
done
echo "smoke: Ray cluster up (head and worker on 127.0.0.1, GCS port $GCS)"

sed "s/port: 8000/port: $HTTP/" "$HERE/pipeline.yaml" >"$WORK/pipeline.yaml"
DEPLOYED=1
"$PYTHON" -m modserve.cli ray serve -c "$WORK/pipeline.yaml" --address "127.0.0.1:$GCS" --detach >"$WORK/deploy.log" 2>&1
echo "smoke: deployed two engine replicas; serving on http://127.0.0.1:$HTTP/v1"

"$PYTHON" "$HERE/smoke_client.py" --url "http://127.0.0.1:$HTTP" --address "127.0.0.1:$GCS" "$@" | tee "$WORK/report.json"
"$PYTHON" - "$WORK/report.json" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
d = r["during"]
print(f"smoke: {d['requests']} requests during the kill: {d['ok']} answered ({d['retried']} after a retry), "
      f"{d['error']} failed cleanly, {d['broken']} broken; replica replaced in {r['recovered_in_s']} s; "
      f"{r['after']['ok']}/{r['after']['requests']} answered afterwards")
sys.exit(0 if r["ok"] else 1)
PY
