"""Loads ``cpu_paged_attention.cpp`` (compiled once per machine by
:mod:`modserve.native.build`) and calls it through ctypes."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch

from modserve.core.contract import NativeFunction
from modserve.native.build import SOURCES, KernelUnavailable, compile_and_load, compiler  # noqa: F401 - re-exported

SOURCE = SOURCES / "cpu_paged_attention.cpp"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


@lru_cache(maxsize=None)
def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled kernel library (compiled now if this machine has no cached build);
    ``extra_flags``: a variant build, e.g. ``("-mno-avx512f",)`` for the portable loops."""
    lib = compile_and_load(SOURCE, "the cpu attention kernel", extra_flags)
    i32 = ctypes.c_int
    lib.modserve_limits.argtypes = [ctypes.POINTER(ctypes.c_int)] * 3
    lib.modserve_tiled.argtypes = [i32]
    lib.modserve_tiled.restype = i32
    return lib


@lru_cache(maxsize=None)
def _paged_attention(lib: ctypes.CDLL) -> NativeFunction:
    """``lib``'s kernel, recordable into a decode step's call list (:mod:`native_calls`)."""
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    return NativeFunction(lib, "modserve_paged_attention", [
        i32, i32, ptr, i64, ptr, i64,  # cache dtype, io_bf16, q, q_stride, out, out_stride
        ptr, ptr, ptr, ptr,  # k_cache, v_cache, k_scale, v_scale
        ptr, ptr, i64, i64, ptr, i32,  # k_new, v_new, their token strides, slots, n_new
        ptr, i32, ptr, ptr, ptr, i32,  # block_tables, width, rows, row_seq, row_pos, n_rows
        i32, i32, i32, i32, f32, i32,  # H, KVH, D, bs, scale, threads
        i32, f32,  # window (0: none), softcap (0: none)
    ], ctypes.c_int)  # fmt: skip


def limits() -> tuple[int, int, int]:
    """(max query heads per KV head, max head_dim, max block_size) the kernel was built for."""
    vals = [ctypes.c_int() for _ in range(3)]
    load().modserve_limits(*[ctypes.byref(v) for v in vals])
    return vals[0].value, vals[1].value, vals[2].value


def tiled(head_dim: int) -> bool:
    """Whether runs of query rows (prefill chunks) take the kernel's tiles (AVX-512, or AVX2
    with FMA) for ``head_dim`` on this machine; where they do, the kernel beats SDPA at
    prefill too."""
    return bool(load().modserve_tiled(head_dim))


@dataclass(frozen=True)
class StepRows:
    """What every layer's call of one step shares, checked once (:func:`step_rows`): the rows
    the kernel attends for, their sequences' block tables, the new K/V rows' slots. At one
    decode row a layer's call is tens of microseconds, and these checks were a sixth of it."""

    block_tables: torch.Tensor  # int32 [B, width]
    rows: torch.Tensor  # int64 [N]: token rows the kernel attends for
    seq: torch.Tensor  # int32 [N]: each row's sequence (row of block_tables)
    pos: torch.Tensor  # int32 [N]: each row's position; it sees cache positions 0..pos
    slots: torch.Tensor | None  # int64: the new K/V rows' cache slots, in order
    args: tuple  # (block_tables, width, rows, row_seq, row_pos, n_rows) as the kernel takes them


def step_rows(
    block_tables: torch.Tensor, rows: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, slots: torch.Tensor | None = None
) -> StepRows:
    """``rows`` int64, ``row_seq`` / ``row_pos`` int32: each row's sequence (its row in
    ``block_tables``, int32) and position (it sees cache positions ``0..pos``); ``slots``: the
    int64 cache slots of the step's new K/V rows, in order."""
    n = rows.numel()
    for name, t, dtype in (("block_tables", block_tables, torch.int32), ("rows", rows, torch.int64),
                           ("row_seq", row_seq, torch.int32), ("row_pos", row_pos, torch.int32)):  # fmt: skip
        if t.dtype != dtype or not t.is_contiguous() or (name != "block_tables" and t.numel() != n):
            raise ValueError(f"cpu paged attention: {name} must be contiguous {dtype}, one per row")
    if slots is not None and (slots.dtype != torch.int64 or not slots.is_contiguous()):
        raise ValueError("cpu paged attention: new_kv slots must be contiguous int64, one per new row")
    args = (block_tables.data_ptr(), block_tables.shape[1], rows.data_ptr(), row_seq.data_ptr(), row_pos.data_ptr(), n)
    return StepRows(block_tables, rows, row_seq, row_pos, slots, args)


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
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """``out[rows] = attention(q[rows])`` over the paged cache, after writing ``new_kv``: one
    call of :func:`attend` on :func:`step_rows` (a backend makes the step's rows once and calls
    :func:`attend` per layer). ``new_kv``: ``(k, v, slots)``, see :func:`attend`."""
    step = step_rows(block_tables, rows, row_seq, row_pos, None if new_kv is None else new_kv[2])
    attend(step, q, out, k_cache, v_cache, k_scale, v_scale, scale, lib, None if new_kv is None else new_kv[:2], window, softcap)


def attend(
    step: StepRows,
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    scale: float,
    lib: ctypes.CDLL | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """``out[rows] = attention(q[rows])`` over the paged cache for ``step``'s rows, after
    writing ``new_kv`` to ``step``'s slots.

    ``q``/``out``: ``[T, H, D]``, both float32 or both bfloat16 (a bfloat16 q over a bfloat16
    cache lets decode rows use bfloat16 dot products, with P.V's weights rounded to bfloat16),
    heads contiguous, any stride between tokens (q may be a view into the qkv rows).
    ``new_kv``: ``(k, v)``, the step's K/V rows ``[N, KVH, D]`` in the cache's dtype (an int8
    cache: in q's dtype, quantized per token and head as :mod:`modserve.core.kv_quant` does),
    one per slot, written before any row attends.
    ``lib``: a variant build from :func:`load` (default: the standard one). ``window``: a row
    at ``pos`` sees positions ``> pos - window`` only; ``softcap``: scaled scores become
    ``softcap * tanh(s / softcap)`` (a layer's settings, see ``AttentionBackend.for_layer``)."""
    _, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    dtype = q.dtype
    if out.dtype != dtype or (dtype != torch.float32 and dtype != torch.bfloat16):
        raise ValueError(f"cpu paged attention: q and out must both be float32 or bfloat16, got {q.dtype}, {out.dtype}")
    q_strides, out_strides = q.stride(), out.stride()
    for name, st in (("q", q_strides), ("out", out_strides)):
        if st[2] != 1 or st[1] != D:
            raise ValueError(f"cpu paged attention: {name} needs contiguous heads, got strides {st}")
    k_new = v_new = slots = None
    k_stride = v_stride = n_new = 0
    if new_kv is not None:
        k_new, v_new = new_kv
        row_dtype = dtype if k_cache.dtype == torch.int8 else k_cache.dtype  # int8: quantized from q's dtype
        for name, t in (("k", k_new), ("v", v_new)):
            st = t.stride()
            if t.dtype != row_dtype or st[2] != 1 or st[1] != D:
                raise ValueError(f"cpu paged attention: new {name} rows must be {row_dtype} with contiguous heads")
        n_new = -1 if step.slots is None else step.slots.numel()
        if n_new != k_new.shape[0] or n_new != v_new.shape[0]:
            raise ValueError("cpu paged attention: new_kv slots must be contiguous int64, one per new row")
        k_stride, v_stride, slots = k_new.stride(0), v_new.stride(0), step.slots.data_ptr()
    code = _paged_attention(lib or load())(
        DTYPE_CODES[k_cache.dtype], int(dtype == torch.bfloat16),
        q.data_ptr(), q_strides[0], out.data_ptr(), out_strides[0],
        k_cache.data_ptr(), v_cache.data_ptr(),
        k_scale.data_ptr() if k_scale is not None else None,
        v_scale.data_ptr() if v_scale is not None else None,
        k_new.data_ptr() if k_new is not None else None, v_new.data_ptr() if v_new is not None else None,
        k_stride, v_stride, slots, n_new, *step.args,
        H, KVH, D, bs, scale, torch.get_num_threads(), window or 0, softcap or 0.0,
    )  # fmt: skip
    if code:
        raise ValueError(f"cpu paged attention: unsupported shape or dtype (code {code})")
