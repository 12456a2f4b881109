"""The Llama layer's elementwise ops as single-pass C++ kernels (float32 or bfloat16, CPU).

Why: unfused, RMSNorm + residual add, SiLU·mul and RoPE are chains of torch ops that each
stream the whole activation through memory; in a 2048-token prefill step they took about
a fifth of the time, and in a bfloat16 decode step their ~80 small ops per layer cost more
than the arithmetic. ``cpu_fused_ops.cpp`` does each in one pass (built once per machine
by :mod:`modserve.native.build`). Results equal the torch ops up to float32 rounding
(fused multiply-adds, a different summation order in the norm); in bfloat16 they round
wherever torch's bfloat16 ops round.

``device: {plugin: cpu, fuse_ops: true}`` (the default) turns it on where it can run: a CPU device, float32
or bfloat16 weights and a working C++ compiler; anything else keeps the torch ops.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import lru_cache

import torch

from modserve.core.native_calls import NativeFunction
from modserve.native.build import SOURCES, KernelUnavailable, compile_and_load

SOURCE = SOURCES / "cpu_fused_ops.cpp"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
log = logging.getLogger("modserve.models")


@dataclass(frozen=True)
class Kernels:
    """The compiled ops, recordable into a decode step's call list (:mod:`native_calls`)."""

    add_rms_norm: NativeFunction
    rms_norm_heads: NativeFunction
    scale: NativeFunction
    silu_mul: NativeFunction
    gelu_tanh_mul: NativeFunction
    rope: NativeFunction
    gather_rows: NativeFunction
    longrope_rows: NativeFunction


@lru_cache(maxsize=1)
def load() -> Kernels:
    lib = compile_and_load(SOURCE, "the fused cpu ops")
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    return Kernels(
        NativeFunction(lib, "modserve_add_rms_norm", [i32, ptr, i64, ptr, ptr, ptr, i64, i32, i32, f32, i32, i32]),
        NativeFunction(lib, "modserve_rms_norm_heads", [i32, ptr, i64, i32, ptr, ptr, i32, i32, f32, i32, i32, i32]),
        NativeFunction(lib, "modserve_scale", [i32, ptr, i64, f32, i32, i32, i32]),
        NativeFunction(lib, "modserve_silu_mul", [i32, ptr, ptr, i32, i32, i32]),
        NativeFunction(lib, "modserve_gelu_tanh_mul", [i32, ptr, ptr, i32, i32, i32]),
        NativeFunction(lib, "modserve_rope", [i32, ptr, i64, ptr, ptr, i32, i32, i32, i32, i32]),
        NativeFunction(lib, "modserve_gather_rows", [i32, ptr, i64, ptr, i32, i32, i32, ptr, i32], ctypes.c_int),
        NativeFunction(lib, "modserve_longrope_rows", [ptr, ptr, ptr, i32, i32, i64, i64, ptr]),
    )


def can_fuse(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the kernels run; says why not (once) when only the compiler is missing."""
    if torch.device(device).type != "cpu" or dtype not in DTYPE_CODES:
        return False
    try:
        load()
    except KernelUnavailable as e:
        log.warning("device.fuse_ops: %s; using torch's unfused ops", e)
        return False
    return True


def add_rms_norm(
    residual: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: bool = False
) -> torch.Tensor:
    """``residual += add`` (in place, when given), then ``rms_norm(residual) * weight``
    (``offset``, Gemma: ``* (1 + weight)`` in float32, rounded once). ``residual``: contiguous
    ``[T, dim]``; ``add``: ``[T, dim]`` with unit inner stride."""
    rows, dim = residual.shape
    if not residual.is_contiguous():
        raise ValueError("fused cpu ops: the residual stream must be contiguous")
    out = torch.empty_like(residual)
    if add is None:
        src, stride, res = residual, residual.stride(0), None
    else:
        src, stride, res = add, add.stride(0), residual.data_ptr()
    code = _check(src, residual, weight)
    load().add_rms_norm(
        code, src.data_ptr(), stride, res, weight.data_ptr(), out.data_ptr(), out.stride(0), rows, dim, eps, offset,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm_heads(
    x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, add_to: torch.Tensor | None = None, offset: bool = False
) -> torch.Tensor:
    """``rms_norm`` of each of ``heads`` equal slices of ``x``'s rows, times ``weight`` (one
    slice wide), into a new contiguous ``[T, width]``: a q/k norm per head (Qwen3) or over the
    whole projection (OLMo 2, ``heads`` 1), read from ``x`` where it lies (a strided view of
    the fused qkv rows, unit inner stride), so no torch copy makes it contiguous first.
    ``add_to`` (contiguous ``[T, width]``): added into it in place instead, and returned (OLMo
    2's ``residual += norm(sublayer)``, rounded as torch's add of the rounded norm). ``offset``:
    Gemma 3's q/k norms (see :func:`add_rms_norm`)."""
    rows, width = x.shape
    if width != heads * weight.shape[0]:
        raise ValueError(f"fused cpu ops: rms_norm_heads of {heads} heads of {weight.shape[0]} over rows of {width}")
    code = _check(x, weight) if add_to is None else _check(x, weight, add_to)
    if add_to is not None and (add_to.shape != x.shape or not add_to.is_contiguous()):
        raise ValueError(f"fused cpu ops: rms_norm_heads adds into a contiguous {tuple(x.shape)}, got {tuple(add_to.shape)}")
    out = torch.empty(rows, width, dtype=x.dtype) if add_to is None else add_to
    load().rms_norm_heads(
        code, x.data_ptr(), x.stride(0), heads, weight.data_ptr(), out.data_ptr(), rows, weight.shape[0], eps,
        add_to is not None, offset, torch.get_num_threads(),
    )  # fmt: skip
    return out


def scale_(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x.mul_(factor)`` for 2-D rows with unit inner stride, as one recordable kernel (the
    same float32 product and rounding as torch's multiply by a Python float); returns ``x``."""
    code = _check(x)
    load().scale(code, x.data_ptr(), x.stride(0), factor, x.shape[0], x.shape[1], torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU) for ``gate_up = [gate | up]``, contiguous ``[T, 2 * inter]``."""
    return _act_mul(gate_up, load().silu_mul)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU, Gemma) for ``gate_up = [gate | up]``, contiguous: gelu
    with the tanh approximation, its tanh from the kernels' exp (within ~1e-6 of torch's)."""
    return _act_mul(gate_up, load().gelu_tanh_mul)


def _act_mul(gate_up: torch.Tensor, kernel: NativeFunction) -> torch.Tensor:
    rows, width = gate_up.shape
    code = _check(gate_up)
    if not gate_up.is_contiguous():
        raise ValueError("fused cpu ops: gate_up must be contiguous")
    out = gate_up.new_empty(rows, width // 2)
    kernel(code, gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int, rotary_dim: int | None = None) -> None:
    """Rotate-half RoPE in place on the first ``rotary_dim`` channels (default: all) of the
    first ``heads`` heads of each row of ``x`` (``[T, >= heads * head_dim]``, unit inner
    stride); ``cos``/``sin``: contiguous ``[T, rotary_dim]``."""
    code = _check(x, cos, sin)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("fused cpu ops: cos and sin must be contiguous")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if cos.shape[-1] != rotary_dim or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"fused cpu ops: rope of {rotary_dim} channels of {head_dim}-wide heads, cos rows of {cos.shape[-1]}")
    load().rope(
        code, x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], heads, rotary_dim, head_dim,
        torch.get_num_threads(),
    )  # fmt: skip


def longrope_rows(positions: torch.Tensor, meta, original: int, max_positions: int) -> torch.Tensor:
    """LongRoPE's table rows for a step (:meth:`RotaryTable._longrope_rows` as one recordable
    kernel): each token's position where its request is longer than ``original``, else the
    short factors' row, position + ``max_positions``. ``meta``: the step's metadata (a token's
    request length from ``request_lens``) or None (its position alone)."""
    positions = positions.to(torch.int64).contiguous()  # no copy where it already is (a decode graph's inputs)
    rows = torch.empty_like(positions)
    lens = None if meta is None else meta.request_lens
    starts = None if lens is None else meta.query_start_loc
    if lens is not None and (lens.dtype != torch.int32 or starts.dtype != torch.int32):
        raise ValueError("fused cpu ops: longrope_rows needs int32 request_lens and query_start_loc")
    load().longrope_rows(
        positions.data_ptr(), None if lens is None else starts.data_ptr(), None if lens is None else lens.data_ptr(),
        0 if lens is None else lens.shape[0], positions.shape[0], original, max_positions, rows.data_ptr(),
    )  # fmt: skip
    return rows


def gather_rows(table: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``table[index].to(dtype)`` as one kernel: the embedding lookup, and the RoPE cos/sin rows
    of a step (float32 table, rounded to the model's dtype as torch rounds). ``table``:
    contiguous ``[rows, width]``; ``index``: ``[T]`` integers, each a row of ``table`` (else IndexError)."""
    if not table.is_contiguous():
        raise ValueError("fused cpu ops: gather_rows needs a contiguous table")
    index = index.to(torch.int64).contiguous()  # no copy where it already is (a decode graph's inputs)
    out = torch.empty(index.shape[0], table.shape[1], dtype=dtype)
    if load().gather_rows(
        _check(table), table.data_ptr(), table.shape[0], index.data_ptr(), index.shape[0], table.shape[1], _check(out),
        out.data_ptr(), torch.get_num_threads(),
    ):  # fmt: skip
        raise IndexError(f"gather_rows: an index is outside the table's {table.shape[0]} rows")
    return out


def _check(*tensors: torch.Tensor) -> int:
    """The kernels' dtype code for tensors that are all float32 or all bfloat16 CPU rows with
    unit inner stride; else ValueError."""
    dtype = tensors[0].dtype
    code = DTYPE_CODES.get(dtype)
    for t in tensors:  # is_cpu, not device.type: this runs a hundred times a decode step (0.9 against 3.1 us)
        if t.dtype != dtype or code is None or not t.is_cpu or t.stride(-1) != 1:
            raise ValueError(
                "fused cpu ops need float32 or bfloat16 CPU rows (all one dtype) with unit inner stride, "
                f"got {[(x.dtype, x.device.type, x.stride()) for x in tensors]}"
            )
    return code
