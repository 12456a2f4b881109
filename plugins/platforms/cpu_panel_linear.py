"""bfloat16 linear layers held as packed panels: 16 outputs by pairs of inputs, the layout both
of the cpu platform's own product kernels read.

Two kernels take the same bytes: AMX tiles (:mod:`cpu_amx_linear`, TDPBF16PS reads a 1 KB B
tile of 16 input pairs x 16 outputs) and AVX512_BF16 (:mod:`cpu_avx512_linear`, VDPBF16PS reads
one 64-byte row of that tile: one input pair of 16 outputs). :class:`PanelLinear` holds a
layer's weights once in that layout and hands rows to its kernel in one ctypes call (no
per-shape state, any row count); for a fused ``[gate; up]`` layer it can return
``silu(gate) * up`` straight from the kernel's sums (:class:`GatedLinear`).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.contract import GatedLinear, NativeFunction
from modserve.native.build import KernelUnavailable, compile_and_load
from modserve.plugins.platforms.cpu_int4_scales import FileScales

TILE_N, TILE_K = 16, 32  # outputs and inputs per packed weight tile


PANEL_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]  # a panel linear's, below
# The int4 entries over weights widened per call: x, x_stride, M, codes, scales, N, K, group, bias, y, y_stride, threads,
# then the scales' kind (0: torch's scales_and_zeros), their outer rows, groups per super block (widened_product).
WIDENED_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


def load_kernel(source, what: str, symbol: str, instructions: str, extra_flags: tuple[str, ...] = (), argtypes: list = PANEL_ARGS,
                restype=None) -> NativeFunction:
    """A kernel built from ``source``, by default a panel linear: ``symbol(x, x_stride, M, packed,
    N, K, bias_f32, y, y_stride, threads, gated)``, with ``<symbol>_available()`` 0 where the
    compiler does not target ``instructions`` on this CPU (then ``KernelUnavailable``, naming
    them). ``extra_flags``: a variant build, e.g. ``("-mno-avx512f",)`` for a kernel's AVX2
    width; ``argtypes``, ``restype``: another kernel's signature (the experts kernel's)."""
    lib = compile_and_load(source, what, extra_flags)
    available = getattr(lib, f"{symbol}_available")
    available.restype = ctypes.c_int
    if not available():
        raise KernelUnavailable(f"{what}: the compiler does not target {instructions} on this CPU (-march=native)")
    return NativeFunction(lib, symbol, argtypes, restype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` weights as ``[N/16][K/32][16][16][2]`` bfloat16 tiles (N, K zero-padded): tile
    row r holds inputs 2r, 2r + 1 of each of its 16 outputs, the pairs TDPBF16PS and VDPBF16PS
    multiply. A panel (16 outputs) is therefore ``[K/2][16][2]``: input pairs in order."""
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


def gated_pairs(packed: torch.Tensor) -> torch.Tensor:
    """A packed ``[gate; up]`` layer's panels reordered as (gate, up) pairs of the same 16
    intermediate columns: the order in which the kernels' gated epilogue reads them."""
    panels = packed.shape[0] // 2
    order = torch.stack([torch.arange(panels), torch.arange(panels) + panels], dim=1).reshape(-1)
    return packed.index_select(0, order).contiguous()


def widened_product(kernel: NativeFunction, rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | FileScales, n: int,
                    k: int, group: int, bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows [M, k]`` (the kernel's dtype) times ``n`` outputs' int4 codes and group scales
    (torch's ``scales_and_zeros``, or a GGUF layer's own: :class:`FileScales`), plus ``bias``
    (``[n]`` float32 or None), by one call of an entry taking :data:`WIDENED_ARGS`. ``out``:
    where to write ``[M, n]`` (unit stride along n, any row stride: a column slice of a wider
    output), else a new tensor."""
    rows = tile_rows(rows)
    out = product_output(rows, n, out, "widened_product")
    pairs, kind, outer, per_block = scale_args(scales)
    kernel(
        rows.data_ptr(), rows.stride(0), rows.shape[0], codes.data_ptr(), pairs, n, k, group,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads(),
        kind, outer, per_block,
    )  # fmt: skip
    return out


def scale_args(scales: torch.Tensor | FileScales) -> tuple[int, int, int | None, int]:
    """An int4 entry's scale arguments: the pairs' address, their kind (0: torch's
    ``scales_and_zeros``), the outer scales' address (or None) and the groups a super block holds."""
    if not isinstance(scales, FileScales):
        return scales.data_ptr(), 0, None, 1
    return scales.pairs.data_ptr(), scales.kind, None if scales.outer is None else scales.outer.data_ptr(), scales.super_groups


def product_output(rows: torch.Tensor, n: int, out: torch.Tensor | None, caller: str) -> torch.Tensor:
    """``out`` checked as where an entry writes ``rows``' ``[M, n]`` product, or a new tensor."""
    if out is None:
        return torch.empty(rows.shape[0], n, dtype=rows.dtype)
    if out.shape != (rows.shape[0], n) or out.dtype != rows.dtype or out.stride(1) != 1:
        raise ValueError(f"{caller}: out must be [{rows.shape[0]}, {n}] {rows.dtype} with unit column stride, "
                         f"got {list(out.shape)} {out.dtype} stride {out.stride()}")
    return out


def tile_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows [M, K]`` as the kernels read them: unit stride along K and rows that do not
    overlap (any stride between rows); a copy only where the view is not."""
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        return rows.contiguous()
    return rows


class PanelLinear(nn.Module, GatedLinear):
    """``y = x @ W.T + b`` for ``x`` of the kernel's ``dtype`` (bfloat16, or float32 for the AVX2
    kernel) with ``W`` held only as packed bfloat16 panels and multiplied by ``kernel``; for a
    fused ``[gate; up]`` layer, on request, ``silu(gate) * up``.

    ``kernel(x, x_stride, M, packed, N, K, bias_f32, y, y_stride, threads, gated)`` is the
    compiled product; ``input_multiple`` the K its rows must be padded to (AMX: a tile row
    reads 32 inputs; VDPBF16PS: none)."""

    gated = False  # forward returns the SiLU-gated product (see enable_silu_mul)
    input_multiple = 1
    dtype = torch.bfloat16  # of the inputs and outputs (the weights are bfloat16 panels either way)
    _extra: tuple = ()  # the kernel's arguments after `gated` (Int8PanelLinear: its scales)

    def __init__(self, linear: nn.Linear, kernel: NativeFunction) -> None:
        super().__init__()
        self._kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.padded_in = -(-self.in_features // self.input_multiple) * self.input_multiple
        self.register_buffer("packed", self._pack(linear), False)
        self.bias = linear.bias
        self.register_buffer("_bias32", None if linear.bias is None else linear.bias.detach().float().contiguous(), False)
        self._width = self.out_features  # of y: out_features, or half of it once gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written for one decode row, where this Python is a visible part of the step (121
        # calls): buffers read from ``_buffers`` (``nn.Module.__getattr__`` costs ~0.3 us a name).
        k = self.in_features
        if x.dtype != self.dtype:
            raise TypeError(f"{type(self).__name__} takes {str(self.dtype).removeprefix('torch.')} inputs, got {x.dtype}")
        if x.shape[-1] != k:
            raise ValueError(f"{type(self).__name__}: inputs of {k} features, got shape {tuple(x.shape)}")
        flat = x.dim() == 2
        rows = tile_rows(x if flat else x.reshape(-1, k))
        m = rows.shape[0]
        if self.padded_in != k:
            rows = F.pad(rows, (0, self.padded_in - k))
        out = torch.empty(m, self._width, dtype=self.dtype)
        if m:
            buffers = self._buffers
            bias = buffers["_bias32"]
            self._kernel(
                rows.data_ptr(), rows.stride(0), m, buffers["packed"].data_ptr(), self.out_features, self.padded_in,
                None if bias is None else bias.data_ptr(), out.data_ptr(), self._width, torch.get_num_threads(),
                self.gated, *self._extra,
            )  # fmt: skip
        return out if flat else out.view(*x.shape[:-1], self._width)

    def _pack(self, linear: nn.Linear) -> torch.Tensor:
        """The layer's weights as the kernel reads them: packed bfloat16 panels."""
        return pack(linear.weight)

    def enable_silu_mul(self) -> bool:
        """Reorder the packed panels as (gate, up) pairs of the same 16 intermediate columns, so
        that the kernel's epilogue computes ``bf16(bf16(silu(gate)) * up)`` (the fused op's
        rounding; in float32, ``silu(gate) * up``) and the ``[gate; up]`` output never goes to
        memory: at 2,048 rows that output and the separate SiLU-mul pass over it took 1.2 ms of
        a layer (SmolLM2). Needs an even split into 16-column panels and no bias."""
        inter = self.out_features // 2
        if self.gated or self.bias is not None or self.out_features % 2 or inter % TILE_N:
            return self.gated
        self.packed = gated_pairs(self.packed)
        self.gated = True
        self._width = inter
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
