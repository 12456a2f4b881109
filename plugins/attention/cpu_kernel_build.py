"""Loads ``cpu_paged_attention.cpp`` (compiled once per machine by
:mod:`modserve.core.native.build`) and calls it through ctypes."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from modserve.core.native.build import KernelUnavailable, compile_and_load, compiler  # noqa: F401 - re-exported

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


@lru_cache(maxsize=None)
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled kernel library (compiled now if this machine has no cached build);
    ``extra_flags``: a variant build, e.g. ``("-mno-avx512f",)`` for the portable loops."""
    lib = compile_and_load(SOURCE, "the cpu attention kernel", extra_flags)
    lib.modserve_paged_attention.restype = ctypes.c_int
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.modserve_paged_attention.argtypes = (
        [i32] + [ptr] * 7 + [i32] + [ptr] * 3 + [i32] * 5 + [ctypes.c_float, i32, i32]
    )  # dtype; q, out, k, v, k_scale, v_scale, tables; width; rows, seq, pos; n, H, KVH, D, bs; scale; q_bf16; threads
    lib.modserve_limits.argtypes = [ctypes.POINTER(ctypes.c_int)] * 3
    lib.modserve_tiled.argtypes = [i32]
    lib.modserve_tiled.restype = i32
    return lib


def limits() -> tuple[int, int, int]:
    """(max query heads per KV head, max head_dim, max block_size) the kernel was built for."""
    vals = [ctypes.c_int() for _ in range(3)]
    load().modserve_limits(*[ctypes.byref(v) for v in vals])
    return vals[0].value, vals[1].value, vals[2].value


def tiled(head_dim: int) -> bool:
    """Whether runs of query rows (prefill chunks) take the kernel's tiled AVX-512 path for
    ``head_dim`` on this machine; where they do, the kernel beats SDPA at prefill too."""
    return bool(load().modserve_tiled(head_dim))


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
    lib: ctypes.CDLL | None = None,
    q_bf16: bool = False,
) -> None:
    """``out[rows] = attention(q[rows])`` over the paged cache. ``q``/``out``: contiguous float32
    ``[T, H, D]``; ``rows`` int64, ``row_seq`` / ``row_pos`` int32: each row's sequence (its row
    in ``block_tables``, int32 contiguous) and position (it sees cache positions ``0..pos``).
    ``lib``: a variant build from :func:`load` (default: the standard one). ``q_bf16``: ``q``'s
    values are bfloat16 values (a bfloat16 model's), so decode rows over a bfloat16 cache may
    use bfloat16 dot products, with P.V's weights rounded to bfloat16."""
    _, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    code = (lib or load()).modserve_paged_attention(
        DTYPE_CODES[k_cache.dtype],
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if k_scale is not None else None,
        v_scale.data_ptr() if v_scale is not None else None,
        block_tables.data_ptr(), block_tables.shape[1],
        rows.data_ptr(), row_seq.data_ptr(), row_pos.data_ptr(), rows.numel(),
        H, KVH, D, bs, scale, int(q_bf16), torch.get_num_threads(),
    )  # fmt: skip
    if code:
        raise ValueError(f"cpu paged attention: unsupported shape or dtype (code {code})")
