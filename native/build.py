"""Compiles a kernel source once per machine and loads it with ctypes.

Why not ``torch.utils.cpp_extension``: these kernels need no torch headers, so a plain
``g++`` call compiles one in about a second instead of a minute, and needs no ninja. The
shared object is cached under ``$MODSERVE_CACHE_DIR`` (default ``~/.cache/modserve``),
keyed by the source, the headers it includes by name (beside it, else the shared ones beside
this file), the compiler, the flags and the CPU's feature flags (``-march=native`` code must
not move to another CPU). It links torch's own ``libgomp.so.1``, so kernels and torch share one
OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCES = HEADERS = Path(__file__).parent  # every kernel source and the shared headers (#include "fast_exp.h")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno", "-fno-trapping-math", f"-I{HEADERS}"]


class KernelUnavailable(RuntimeError):
    """No C++ compiler, or it failed: the kernel cannot run here."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def compile_and_load(source: Path, what: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled ``source`` (compiled now if this machine has no cached build); ``what``
    names it in errors, e.g. "the cpu attention kernel". ``extra_flags`` follow the standard
    ones: the tests build ``-mno-avx512f`` variants to check the portable loops on a CPU
    where the AVX-512 ones would run."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable(f"{what} needs a C++ compiler (g++); none found on PATH or in $CXX")
    flags = [*FLAGS, *extra_flags]
    path = _cache_dir() / f"{source.stem}-{_build_key(cxx, source, flags)}.so"
    if not path.exists():
        _compile(cxx, flags, source, path, what)
    return ctypes.CDLL(str(path))


def compile_and_load_amx(source: Path, what: str) -> ctypes.CDLL:
    """An AMX kernel (``source`` exports ``modserve_amx_init``, see ``amx.h``) with this
    process granted the tile state; raises :class:`KernelUnavailable` saying why it cannot run."""
    lib = compile_and_load(source, what)
    lib.modserve_amx_init.restype = ctypes.c_int
    status = lib.modserve_amx_init()
    if status == -2:  # the source's fallback: built without the AMX instructions it needs
        raise KernelUnavailable(f"{what}: the compiler does not target the AMX instructions it needs on this CPU (-march=native)")
    if status != 0:
        raise KernelUnavailable(f"{what}: Linux refused this process the AMX tile state (arch_prctl)")
    return lib


def _cache_dir() -> Path:
    root = Path(os.environ.get("MODSERVE_CACHE_DIR") or Path.home() / ".cache" / "modserve") / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _build_key(cxx: str, source: Path, flags: list[str]) -> str:
    h = hashlib.sha256(source.read_bytes())
    for header in _headers_read(source):
        h.update(header.read_bytes())
    h.update(" ".join([cxx, *flags]).encode())
    try:
        h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.encode())
        with open("/proc/cpuinfo") as f:
            h.update(next((line for line in f if line.startswith("flags")), "").encode())
    except (OSError, subprocess.SubprocessError):
        pass
    return h.hexdigest()[:16]


def _headers_read(source: Path) -> list[Path]:
    """The headers a build of ``source`` can read: a quoted #include looks beside the source
    before the shared ones (-I), so a copy of another revision's kernels (``git archive REV
    native``, a benchmark's --baseline-source) builds with its own headers, and must not share a
    cache key with this tree's build when only a header differs: keyed by the shared headers
    alone, such a baseline loaded this tree's cached build instead."""
    beside = {h.name: h for h in source.parent.glob("*.h")}
    shared = sorted(HEADERS.glob("*.h"))
    return [beside.get(h.name, h) for h in shared] + sorted(h for name, h in beside.items() if not (HEADERS / name).exists())


def _compile(cxx: str, flags: list[str], source: Path, path: Path, what: str) -> None:
    """Compile into a temporary file, then rename: concurrent processes never load half a file."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise KernelUnavailable(f"compiling {what} failed ({cxx}): {proc.stderr.strip()[-800:]}")
        os.replace(tmp, path)
    except OSError as e:
        raise KernelUnavailable(f"compiling {what} failed ({cxx}): {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prebuild(workers: int | None = None) -> dict[str, str | None]:
    """Compile every kernel source for this machine now, ``workers`` at a time (default: one a
    core), so the first ``serve`` does not wait for g++ (the largest kernels take 30-60 s each
    at ``-O3`` on a 2.5 GHz core); ``{source name: None, or why it cannot be built}``."""
    sources = sorted(SOURCES.glob("*.cpp"))

    def build(source: Path) -> str | None:
        try:
            compile_and_load(source, source.name)
            return None
        except KernelUnavailable as e:
            return str(e)

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return dict(zip((s.name for s in sources), pool.map(build, sources)))


if __name__ == "__main__":  # python -m modserve.native.build: scripts/setup.sh runs it
    start = time.perf_counter()
    failed = {name: why for name, why in prebuild().items() if why}
    for name, why in failed.items():
        print(f"modserve: {name} not built ({why}); the platform falls back where it needs it", file=sys.stderr)
    print(f"modserve: CPU kernels built in {time.perf_counter() - start:.0f} s, cached in {_cache_dir()}")
