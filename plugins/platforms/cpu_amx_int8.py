"""W8A8 products on AMX-INT8 tiles (``native/cpu_amx_int8_linear.cpp``): one call quantizes
the rows per token, multiplies int8 by int8 into int32 sums and applies both scales and the
bias while narrowing to bfloat16. Used by :class:`~modserve.plugins.platforms.cpu_quant.W8A8Linear`
for bfloat16 models where the platform's linears run on AMX tiles.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from modserve.core.contract import NativeFunction
from modserve.native.build import SOURCES, compile_and_load_amx
from modserve.plugins.platforms.cpu_panel_linear import pack_tiles, tile_rows

SOURCE = SOURCES / "cpu_amx_int8_linear.cpp"
TILE_K = 64  # int8 inputs per packed weight tile


@functools.cache
def load() -> NativeFunction:
    """The compiled kernel, this process granted AMX state; raises ``KernelUnavailable``."""
    lib = compile_and_load_amx(SOURCE, "the AMX int8 linear kernel")
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return NativeFunction(lib, "modserve_amx_w8a8", [ptr, i64, i64, i32, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i32])


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` weights as ``[N/16][K/64][16][16][4]`` tiles (zero-padded): tile row r
    holds inputs 4r..4r+3 of each of its 16 outputs, the quadruples TDPBSSD multiplies."""
    return pack_tiles(q, 4)


def w8a8_product(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``rows [M, K]`` bfloat16 quantized per row and multiplied by the packed int8 weights
    (``scale [N]`` float32, ``bias [N]`` float32 or None): ``[M, N]`` bfloat16."""
    m, k = rows.shape
    rows = tile_rows(rows)
    k_pad = -(-k // TILE_K) * TILE_K
    q = torch.empty(m * k_pad, dtype=torch.int8)
    row_scale = torch.empty(m, dtype=torch.float32)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    load()(
        rows.data_ptr(), rows.stride(0), m, k, packed.data_ptr(), scale.data_ptr(), n,
        None if bias is None else bias.data_ptr(), q.data_ptr(), row_scale.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out
