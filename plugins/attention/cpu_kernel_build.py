"""Builds ``cpu_paged_attention.cpp`` once per machine and calls it through ctypes.

Why not ``torch.utils.cpp_extension``: the kernel needs no torch headers, so a plain
``g++`` call compiles it in about a second instead of a minute, and needs no ninja. The
shared object is cached under ``$MODSERVE_CACHE_DIR`` (default ``~/.cache/modserve``),
keyed by the source, the compiler, the flags and the CPU's feature flags (``-march=native``
code must not move to another CPU). It links torch's own ``libgomp.so.1``, so both share
one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


class KernelUnavailable(RuntimeError):
    """No C++ compiler, or it failed: the ``cpu`` attention backend cannot run here."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The compiled kernel library (compiled now if this machine has no cached build)."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("the cpu attention kernel needs a C++ compiler (g++); none found on PATH or in $CXX")
    path = _cache_dir() / f"cpu_paged_attention-{_build_key(cxx)}.so"
    if not path.exists():
        _compile(cxx, path)
    lib = ctypes.CDLL(str(path))
    lib.modserve_paged_attention.restype = ctypes.c_int
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.modserve_paged_attention.argtypes = (
        [i32] + [ptr] * 7 + [i32] + [ptr] * 3 + [i32] * 5 + [ctypes.c_float, i32]
    )  # dtype; q, out, k, v, k_scale, v_scale, tables; width; rows, seq, pos; n, H, KVH, D, bs; scale; threads
    lib.modserve_limits.argtypes = [ctypes.POINTER(ctypes.c_int)] * 3
    return lib


def limits() -> tuple[int, int, int]:
    """(max query heads per KV head, max head_dim, max block_size) the kernel was built for."""
    vals = [ctypes.c_int() for _ in range(3)]
    load().modserve_limits(*[ctypes.byref(v) for v in vals])
    return vals[0].value, vals[1].value, vals[2].value


def _cache_dir() -> Path:
    root = Path(os.environ.get("MODSERVE_CACHE_DIR") or Path.home() / ".cache" / "modserve") / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _build_key(cxx: str) -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join([cxx, *FLAGS]).encode())
    try:
        h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.encode())
        with open("/proc/cpuinfo") as f:
            h.update(next((line for line in f if line.startswith("flags")), "").encode())
    except (OSError, subprocess.SubprocessError):
        pass
    return h.hexdigest()[:16]


def _compile(cxx: str, path: Path) -> None:
    """Compile into a temporary file, then rename: concurrent processes never load half a file."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise KernelUnavailable(f"compiling the cpu attention kernel failed ({cxx}): {proc.stderr.strip()[-800:]}")
        os.replace(tmp, path)
    except OSError as e:
        raise KernelUnavailable(f"compiling the cpu attention kernel failed ({cxx}): {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def paged_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    scale: float,
) -> None:
    """``out[rows] = attention(q[rows])`` over the paged cache. ``q``/``out``: contiguous float32
    ``[T, H, D]``; ``rows`` int64, ``row_seq`` / ``row_pos`` int32: each row's sequence (its row
    in ``block_tables``, int32 contiguous) and position (it sees cache positions ``0..pos``)."""
    _, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    code = load().modserve_paged_attention(
        DTYPE_CODES[k_cache.dtype],
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if k_scale is not None else None,
        v_scale.data_ptr() if v_scale is not None else None,
        block_tables.data_ptr(), block_tables.shape[1],
        rows.data_ptr(), row_seq.data_ptr(), row_pos.data_ptr(), rows.numel(),
        H, KVH, D, bs, scale, torch.get_num_threads(),
    )  # fmt: skip
    if code:
        raise ValueError(f"cpu paged attention: unsupported shape or dtype (code {code})")
