"""bfloat16 linear layers on AMX tiles, weights packed once in the tiles' layout.

Why, where oneDNN's packed product (:mod:`cpu_linear`) already uses AMX: each oneDNN call
costs ~20 us before its first product, and it keeps a primitive per row count, so rows are
padded to a fixed set of sizes. ``native/cpu_amx_linear.cpp`` is one ctypes call and one
OpenMP region, takes any row count, and streams a thread's weights in memory order.
Measured on SmolLM2's 30 layers plus head with weights from memory (AMX Xeon, 2 cores):
1 row 10.1 vs 17.3 ms, 16 rows 10.9 vs 15.4, 64 rows 16.4 vs 20.2, 300 rows 54.1 vs 59.1,
1,024 rows even (``docs/cpu_linears.md``). The weights take the same bytes as oneDNN's
copy. Results equal ``F.linear`` up to float32 summation order.

Used by the ``cpu`` platform for bfloat16 models on CPUs with AMX-BF16 (``device:
{linear_kernel: auto}``); the weights are packed as :mod:`cpu_panel_linear` holds them, which
the AVX512_BF16 kernel (:mod:`cpu_avx512_linear`, CPUs without AMX) reads too.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
from torch import nn

from modserve.core.contract import NativeFunction
from modserve.native.build import SOURCES, compile_and_load_amx
from modserve.plugins.platforms.cpu_panel_linear import TILE_K, PanelLinear, tile_rows

SOURCE = SOURCES / "cpu_amx_linear.cpp"


@dataclass(frozen=True)
class AmxKernels:
    """The library's products, recordable into a decode step's call list."""

    linear: NativeFunction  # bfloat16 panels (PanelLinear's kernel)
    int4: NativeFunction
    int8: NativeFunction


@functools.cache
def load() -> AmxKernels:
    """The compiled kernel, this process granted AMX state; raises ``KernelUnavailable``
    (``cpu.amx_unavailable`` says why it cannot run here)."""
    lib = compile_and_load_amx(SOURCE, "the AMX linear kernel")
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return AmxKernels(
        NativeFunction(lib, "modserve_amx_linear", [ptr, i64, i64, ptr, i64, i32, ptr, ptr, i64, i32, i32]),
        NativeFunction(lib, "modserve_amx_linear_int4", [ptr, i64, i64, ptr, ptr, i64, i32, i32, ptr, ptr, i64, i32]),
        NativeFunction(lib, "modserve_amx_linear_int8", [ptr, i64, i64, ptr, ptr, i64, i32, ptr, ptr, ptr, i64, i32]),
    )


_widened = torch.empty(0, dtype=torch.bfloat16)  # int4/int8_product's widened tiles, shared by every layer


def _scratch(elements: int) -> torch.Tensor:
    """One buffer for every int4 and int8 layer's widened tiles, grown to the largest layer: it
    stays in the caches between layers (a fresh 3.5 MB tensor per call costs page faults too)."""
    global _widened
    if _widened.numel() < elements:
        _widened = torch.empty(elements, dtype=torch.bfloat16)
    return _widened


def int4_product(rows: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """``rows @ W.T`` in bfloat16 for int4 ``W`` held as torch's CPU int4 kernel holds it on AVX-512
    (``packed`` from :func:`~modserve.plugins.platforms.cpu_int4_packing.pack_int4`, ``[N, K/2]`` uint8, N a multiple
    of 64; ``scales_and_zeros`` ``[K/group, N, 2]`` bfloat16; K and the group multiples of 32):
    each thread widens its share of the weights to bfloat16 tiles in a scratch buffer and runs
    the AMX product on them while they sit in its cache. For many rows, where torch's int4
    kernel (a matrix-vector product per row) is slow; ``rows`` ``[M, K]`` bfloat16."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = tile_rows(rows)
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    scratch = _scratch(n * k)
    load().int4(
        rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), scales_and_zeros.data_ptr(), n, k, group,
        scratch.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out


def int8_product(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``(rows @ q.T) * scale + bias`` in bfloat16 for int8 ``q`` packed by :func:`pack_tiles`
    (``[N/16][K/32][16][16][2]``), ``scale [N]`` and ``bias [N]`` float32: each thread widens its
    share of ``q`` to bfloat16 tiles (exact) in a scratch buffer and runs the AMX product on
    them, the channel scales and the bias applied to the float32 sums. ``rows`` ``[M, K]``
    bfloat16 with K a multiple of 32."""
    k = packed.shape[1] * TILE_K
    rows = tile_rows(rows)
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    scratch = _scratch(-(-n // 32) * 32 * k)
    load().int8(
        rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), scale.data_ptr(), n, k,
        None if bias is None else bias.data_ptr(), scratch.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out


class AmxLinear(PanelLinear):
    """``y = x @ W.T + b`` for bfloat16 ``x`` on AMX tiles (a tile row reads 32 inputs: rows
    are padded with zeros to a multiple of 32); gated on request (:class:`PanelLinear`)."""

    input_multiple = TILE_K

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, load().linear)
