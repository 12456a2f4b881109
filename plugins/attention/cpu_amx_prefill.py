"""Loads ``native/cpu_amx_attention.cpp`` (causal bfloat16 prefill attention on AMX tiles)
and runs a step's prefill chunks through it.

Why: torch's flash SDPA runs SmolLM2's chunks (9 heads of 64) at 300-600 GFLOP/s on a CPU
whose AMX products reach ~2.8 TFLOP/s; the kernel computes both products of each 16-row x
32-key block on tiles and the softmax lane-wise between them: 1.38x SDPA at 256 tokens,
1.61x at 512, 1.20x at 2,048 (``docs/cpu_attention.md``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from modserve.core.contract import LayerKVCache
from modserve.native.build import SOURCES, compile_and_load_amx
from modserve.plugins.platforms.cpu import amx_unavailable

SOURCE = SOURCES / "cpu_amx_attention.cpp"
HEAD_DIMS = (64, 128)


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled kernel, this process granted AMX state; raises ``KernelUnavailable``
    (:func:`unavailable` says why it cannot run here)."""
    lib = compile_and_load_amx(SOURCE, "the AMX prefill attention kernel")
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.modserve_amx_prefill.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    lib.modserve_amx_prefill.restype = i32
    return lib


def unavailable(dtype: torch.dtype, head_dim: int) -> str | None:
    """None where the kernel serves a model of this dtype and head size on this CPU, else why not."""
    if dtype != torch.bfloat16:
        return f"it runs bfloat16 models, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"it takes head_dim 64 or 128, not {head_dim}"
    return amx_unavailable(load)


def _heads_packed(t: torch.Tensor) -> bool:
    """Whether ``[tokens, heads, head_dim]`` has heads and dims packed (any stride between tokens)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if _heads_packed(t) else t.contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Causal attention of ``q`` ([Q, H, D]) over ``k``, ``v`` ([S, KVH, D], S >= Q; query row
    i at position S - Q + i) into ``out`` ([Q, H, D] view), all bfloat16."""
    q, k, v = _rows(q), _rows(k), _rows(v)
    if k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    target = out if _heads_packed(out) else torch.empty_like(q)
    n_q, heads, d = q.shape
    rc = load().modserve_amx_prefill(
        q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), target.data_ptr(), target.stride(0),
        n_q, k.shape[0], heads, k.shape[1], d, scale, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"the AMX prefill kernel refused head_dim {d}")
    if target is not out:
        out.copy_(target)


def run_prefills(q, k, v, cache: LayerKVCache, prefills, out, scale: float) -> None:
    """Each chunk over its cached context (read from the blocks) plus its new rows, into ``out``
    (the ``cpu`` backend's chunks: see ``torch_backend.run_prefills`` for SDPA's version)."""
    from modserve.plugins.attention.torch_backend import read_blocks

    for p in prefills:
        if p.mask is None:  # no cached context: the chunk's own rows are all its keys
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:
            kp, vp = read_blocks(cache, p.block_ids, q.dtype)
            kp, vp = kp[: p.seq_len], vp[: p.seq_len]
        attend(q[p.start : p.end], kp, vp, out[p.start : p.end], scale)
