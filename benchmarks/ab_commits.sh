#!/usr/bin/env bash
# Throughput of an older commit against the working tree, alternated in one sitting.
#
#   benchmarks/ab_commits.sh REV [ROUNDS] [-- bench throughput args...]
#
# Runs `modserve bench throughput` ROUNDS times for each side (default 6), swapping the order
# every other round so a drifting machine moves both, and prints each round's ratio and the
# median. The old side runs from a git worktree of REV, imported ahead of the editable install
# through a small PYTHONPATH shim (its core/ and plugins/ mapped into a modserve package), so
# both sides use this checkout's .venv. Raw output goes to benchmarks/results/ab-<REV>/ (ignored).
# Keep the machine otherwise idle while it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: benchmarks/ab_commits.sh REV [ROUNDS] [-- bench args]}
ROUNDS=${2:-6}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS: expected an integer >= 1, got '$ROUNDS'" >&2; exit 2; }
shift $(( $# >= 2 ? 2 : 1 ))
[ "${1:-}" = "--" ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--num-prompts 64 --input-len 128 --output-len 128 --max-num-seqs 32 --dtype bfloat16)
PY="$PWD/.venv/bin/python"
OUT="benchmarks/results/ab-$REV"
WORK=$(mktemp -d)
trap 'git worktree remove --force "$WORK/tree" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add -q --detach "$WORK/tree" "$REV"
mkdir -p "$WORK/shim/modserve" "$OUT"
cp "$WORK/tree/modserve/__init__.py" "$WORK/shim/modserve/"
ln -s "$WORK/tree/core" "$WORK/shim/modserve/core"
ln -s "$WORK/tree/plugins" "$WORK/shim/modserve/plugins"
[ -d "$WORK/tree/bench" ] && ln -s "$WORK/tree/bench" "$WORK/shim/modserve/bench"
[ -d "$WORK/tree/native" ] && ln -s "$WORK/tree/native" "$WORK/shim/modserve/native"
[ -f "$WORK/tree/modserve/cli.py" ] && OLD_CLI=modserve.cli || OLD_CLI=modserve.core.cli
side() {  # side NAME ROUND
    if [ "$1" = old ]; then (cd "$WORK" && PYTHONPATH="$WORK/shim" "$PY" -m "$OLD_CLI" bench throughput "${ARGS[@]}")
    else "$PY" -m modserve.cli bench throughput "${ARGS[@]}"; fi > "$OUT/$1_$2.txt" 2>&1
    tail -n 1 "$OUT/$1_$2.txt" | awk '{print $4}'
}
lscpu | grep -E "Model name" | sed 's/  */ /g'
ratios=()
for r in $(seq 1 "$ROUNDS"); do
    if (( r % 2 )); then old=$(side old "$r"); new=$(side new "$r"); else new=$(side new "$r"); old=$(side old "$r"); fi
    ratio=$(python3 -c "print(round($new / $old, 3))")
    ratios+=("$ratio")
    echo "round $r: $REV $old, working tree $new out tok/s, ratio $ratio"
done
python3 -c "import statistics, sys; r = [float(x) for x in sys.argv[1:]]; print(f'median ratio {statistics.median(r):.3f} (range {min(r):.3f}-{max(r):.3f}, {len(r)} rounds)')" "${ratios[@]}"
