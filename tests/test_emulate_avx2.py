"""``benchmarks/emulate_avx2.sh``: what a command runs under it is built without AVX-512 but
with this core's tuning (or for the named core), its libraries are capped to AVX2, and a bad
setting is refused by name before anything runs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "emulate_avx2.sh"
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def run(tmp_path, command: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "MODSERVE_CACHE_DIR": str(tmp_path / "cache"), **env}
    full.pop("CXX", None)
    return subprocess.run(["bash", str(SCRIPT), "bash", "-c", command], env=full, capture_output=True, text=True, timeout=60)


def macros(r: subprocess.CompletedProcess) -> set[str]:
    return {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define")}


@needs_gxx
def test_the_wrapper_builds_for_this_core_without_avx512(tmp_path):
    """-march=native becomes "-march=native -mno-avx512f": no __AVX512F__ even where the CPU has
    it, AVX2 and FMA kept where it has them, and the same tuning macros as a native build (on an
    AMD Zen, the __znverN__ that the attention kernel's Zen paths key on)."""
    r = run(tmp_path, 'echo "$CXX $ONEDNN_MAX_CPU_ISA $ATEN_CPU_CAPABILITY $MKL_ENABLE_INSTRUCTIONS $MODSERVE_CACHE_DIR" >&2; '
                      '"$CXX" -march=native -dM -E -x c++ /dev/null')
    assert r.returncode == 0, r.stderr
    cxx, *caps, cache = r.stderr.split()
    assert caps == ["AVX2", "avx2", "AVX2"] and cache == str(tmp_path / "cache") and cxx == str(tmp_path / "cache" / "cxx")
    native_macros = macros(subprocess.run(["g++", "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True,
                                          text=True))
    got = macros(r)
    assert not {m for m in got if m.startswith("__AVX512")}
    assert {m for m in native_macros if "tune" in m or "znver" in m} <= got
    if "__AVX2__" in native_macros:
        assert {"__AVX2__", "__FMA__"} <= got


@needs_gxx
def test_core_names_the_target(tmp_path):
    r = run(tmp_path, '"$CXX" -march=native -dM -E -x c++ /dev/null', CORE="haswell")
    assert r.returncode == 0, r.stderr
    got = macros(r)
    assert {"__AVX2__", "__FMA__", "__haswell", "__tune_haswell__"} <= got and not {m for m in got if "znver" in m}


@pytest.mark.parametrize("args,env,message", [
    ([], {}, "usage: [CORE=native|haswell|...]"),
    (["true"], {"CORE": "has well"}, "CORE: expected a -march name such as native or haswell, got 'has well'"),
])
def test_a_bad_call_exits_2_naming_what(tmp_path, args, env, message):
    r = subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "MODSERVE_CACHE_DIR": str(tmp_path / "c"), **env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "c").exists()  # refused before anything was written
