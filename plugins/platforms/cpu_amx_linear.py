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
{linear_kernel: auto}``); elsewhere, or without a C++ compiler, :class:`PackedLinear`.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.contract import GatedLinear
from modserve.native.build import SOURCES, compile_and_load_amx

SOURCE = SOURCES / "cpu_amx_linear.cpp"
TILE_N, TILE_K = 16, 32  # outputs and inputs per packed weight tile


@functools.cache
def load() -> ctypes.CDLL:
    """The compiled kernel, this process granted AMX state; raises ``KernelUnavailable``
    (``cpu.amx_unavailable`` says why it cannot run here)."""
    lib = compile_and_load_amx(SOURCE, "the AMX linear kernel")
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.modserve_amx_linear.argtypes = [ptr, i64, i64, ptr, i64, i32, ptr, ptr, i64, i32, i32]
    lib.modserve_amx_linear.restype = None
    lib.modserve_amx_linear_int4.argtypes = [ptr, i64, i64, ptr, ptr, i64, i32, i32, ptr, ptr, i64, i32]
    lib.modserve_amx_linear_int4.restype = None
    lib.modserve_amx_linear_int8.argtypes = [ptr, i64, i64, ptr, ptr, i64, i32, ptr, ptr, ptr, i64, i32]
    lib.modserve_amx_linear_int8.restype = None
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` weights as ``[N/16][K/32][16][16][2]`` bfloat16 tiles (N, K zero-padded): tile
    row r holds inputs 2r, 2r + 1 of each of its 16 outputs, the pairs TDPBF16PS multiplies."""
    return pack_tiles(weight.detach().to(torch.bfloat16))


def pack_tiles(weight: torch.Tensor, per: int = 2) -> torch.Tensor:
    """``[N, K]`` in ``weight``'s own dtype as ``[N/16][K/(16 per)][16][16][per]`` tiles (N, K
    zero-padded): tile row r holds inputs ``per r .. per r + per - 1`` of each of its 16 outputs.
    ``per`` 2: bfloat16 pairs (TDPBF16PS; also the int8 codes the kernel widens to them), 4:
    int8 quadruples (TDPBSSD)."""
    n, k = weight.shape
    k_tile = TILE_N * per
    n_pad, k_pad = -(-n // TILE_N) * TILE_N, -(-k // k_tile) * k_tile
    w = F.pad(weight, (0, k_pad - k, 0, n_pad - n))
    return w.view(n_pad // TILE_N, TILE_N, k_pad // k_tile, TILE_N, per).permute(0, 2, 3, 1, 4).contiguous()


def tile_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows [M, K]`` as the kernels read them: unit stride along K and rows that do not
    overlap (any stride between rows); a copy only where the view is not."""
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        return rows.contiguous()
    return rows


_widened = torch.empty(0, dtype=torch.bfloat16)  # int4/int8_product's widened tiles, shared by every layer


def _scratch(elements: int) -> torch.Tensor:
    """One buffer for every int4 and int8 layer's widened tiles, grown to the largest layer: it
    stays in the caches between layers (a fresh 3.5 MB tensor per call costs page faults too)."""
    global _widened
    if _widened.numel() < elements:
        _widened = torch.empty(elements, dtype=torch.bfloat16)
    return _widened


def int4_product(rows: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """``rows @ W.T`` in bfloat16 for int4 ``W`` held as torch's CPU int4 kernel holds it
    (``packed`` from ``_convert_weight_to_int4pack_for_cpu``, ``[N, K/2]`` uint8, N a multiple
    of 64; ``scales_and_zeros`` ``[K/group, N, 2]`` bfloat16; K and the group multiples of 32):
    each thread widens its share of the weights to bfloat16 tiles in a scratch buffer and runs
    the AMX product on them while they sit in its cache. For many rows, where torch's int4
    kernel (a matrix-vector product per row) is slow; ``rows`` ``[M, K]`` bfloat16."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = tile_rows(rows)
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    scratch = _scratch(n * k)
    load().modserve_amx_linear_int4(
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
    load().modserve_amx_linear_int8(
        rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), scale.data_ptr(), n, k,
        None if bias is None else bias.data_ptr(), scratch.data_ptr(), out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out


class AmxLinear(nn.Module, GatedLinear):
    """``y = x @ W.T + b`` for bfloat16 ``x`` with ``W`` held only as packed AMX tiles; for a
    fused ``[gate; up]`` layer, on request, ``silu(gate) * up`` straight from the tiles."""

    gated = False  # forward returns the SiLU-gated product (see enable_silu_mul)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._lib = load()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.padded_in = -(-self.in_features // TILE_K) * TILE_K
        self.register_buffer("packed", pack(linear.weight), False)
        self.bias = linear.bias
        self.register_buffer("_bias32", None if linear.bias is None else linear.bias.detach().float().contiguous(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"AmxLinear takes bfloat16 inputs, got {x.dtype}")
        rows = tile_rows(x.reshape(-1, self.in_features))
        if self.padded_in != self.in_features:  # a tile row reads 32 inputs: pad with zeros
            rows = F.pad(rows, (0, self.padded_in - self.in_features))
        m = rows.shape[0]
        width = self.out_features // 2 if self.gated else self.out_features
        out = torch.empty(m, width, dtype=torch.bfloat16)
        if m:
            bias = self._bias32
            self._lib.modserve_amx_linear(
                rows.data_ptr(), rows.stride(0), m, self.packed.data_ptr(), self.out_features, self.padded_in,
                None if bias is None else bias.data_ptr(), out.data_ptr(), width, torch.get_num_threads(), int(self.gated),
            )  # fmt: skip
        return out.view(*x.shape[:-1], width)

    def enable_silu_mul(self) -> bool:
        """Reorder the packed panels as (gate, up) pairs of the same 16 intermediate columns, so
        that each block's epilogue computes ``bf16(bf16(silu(gate)) * up)`` (the fused op's
        rounding) and the ``[gate; up]`` output never goes to memory: at 2,048 rows that output
        and the separate SiLU-mul pass over it took 1.2 ms of a layer (SmolLM2). Needs an even
        split into 16-column panels and no bias."""
        inter = self.out_features // 2
        if self.gated or self.bias is not None or self.out_features % 2 or inter % TILE_N:
            return self.gated
        panels = inter // TILE_N
        order = torch.stack([torch.arange(panels), torch.arange(panels) + panels], dim=1).reshape(-1)
        self.packed = self.packed.index_select(0, order).contiguous()
        self.gated = True
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
