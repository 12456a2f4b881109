"""float32 linear layers whose weights are exact in bfloat16, held as bfloat16 panels and
multiplied in float32 with AVX2 and FMA (AVX-512 wide where the CPU has it): a bfloat16
checkpoint served in float32.

Why: float32 is the default dtype on CPUs without native bfloat16 arithmetic (AVX2-only ones,
AVX-512 ones without AVX512_BF16), and there a decode step's time is its weight bytes over the
memory bandwidth. When every weight of a layer is a bfloat16 value (as every weight of a
bfloat16 checkpoint is), holding it in bfloat16 loses nothing and halves those bytes; the
kernel (``native/cpu_avx2_linear.cpp``) widens each weight with a shift or a mask and sums in
float32, so results equal ``F.linear``'s up to float32 summation order. It also makes such a
model's decode steps recordable as call lists (oneDNN's float32 product is not).

A layer with any weight that bfloat16 cannot hold keeps oneDNN's float32 product: rounding it
would change the model.

From ``LIBRARY_FROM_ROWS`` rows (long prefill chunks) a plain layer's panels are widened back
to float32 into one scratch matrix a thread and oneDNN's float32 product multiplies them
(:func:`~modserve.plugins.platforms.cpu_linear.float32_product`; not ``F.linear``, whose MKL
sgemm ran 1.3x slower on a Zen 4): there the product is bound by the FMAs, not by the weight
bytes, and the library's blocking beats the panel kernel's (1.1-1.3x on a Cascade Lake at
512-1,024 rows, SmolLM2's qkv and down shapes) by more than the widening costs (about 0.15 ms a
layer, each tile transposed in registers). Not on every CPU: where the FMAs are 256 bits wide
(AMD up to Zen 4) the panels win at every row count, and the platform builds the layers with
:data:`PANELS_ONLY` (:func:`~modserve.plugins.platforms.cpu.library_from_rows`). A gated
layer stays on the panels: the library's output twice as wide and a separate SiLU pass over it
made it 0.7-0.8x slower.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import torch
from torch import nn

from modserve.core.contract import NativeFunction
from modserve.native.build import SOURCES, compile_and_load
from modserve.plugins.platforms.cpu_int4_scales import FileScales
from modserve.plugins.platforms.cpu_int8_panel_linear import load_int8
from modserve.plugins.platforms.cpu_linear import float32_product
from modserve.plugins.platforms.cpu_panel_linear import WIDENED_ARGS, PanelLinear, load_kernel, product_output, scale_args, widened_product

SOURCE = SOURCES / "cpu_avx2_linear.cpp"
LIBRARY_FROM_ROWS = 512  # rows from which the widened weights go to oneDNN's float32 product
INT4_LIBRARY_FROM_ROWS = 128  # the same for int4 weights (widened to float32 panels, the FMA blocks lose more)
PANELS_ONLY = sys.maxsize  # a library_from_rows no call reaches: every row count stays on the panels (cpu.library_from_rows)
WIDEN_ARGS = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
INT4_WIDEN_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
_scratch = threading.local()  # .matrix: the float32 matrix every layer widens into, a product at a time (per thread: engines may share a process)


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> NativeFunction:
    """The compiled kernel (AVX-512 wide where the compiler targets AVX-512F; ``extra_flags``
    ``("-mno-avx512f",)`` builds the AVX2 width there, as the tests do); raises
    ``KernelUnavailable`` where it cannot be built, or where the compiler does not target AVX2
    and FMA on this CPU (``-march=native``)."""
    return load_kernel(SOURCE, "the AVX2 linear kernel", "modserve_avx2_linear", "AVX2 and FMA", extra_flags)


@functools.cache
def load_int4(extra_flags: tuple[str, ...] = ()) -> NativeFunction:
    """The same kernel's entry over int4 weights as torch's int4 kernel holds them, widened to
    float32 panels per call (:func:`int4_product`)."""
    return load_kernel(SOURCE, "the AVX2 linear kernel", "modserve_avx2_linear_int4", "AVX2 and FMA", extra_flags, WIDENED_ARGS)


def int4_product(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | FileScales, group: int,
                 bias: torch.Tensor | None = None, extra_flags: tuple[str, ...] = (), out: torch.Tensor | None = None,
                 library_from: int | None = None) -> torch.Tensor:
    """``rows @ W.T + bias`` in float32 for int4 ``W`` held as torch's CPU int4 kernel holds it
    (``packed`` ``[N, K/2]`` uint8, N a multiple of 64; ``scales`` torch's ``scales_and_zeros``
    ``[K/group, N, 2]`` float32, or the file's own (:class:`FileScales`); K and the group
    multiples of 32; ``bias`` ``[N]`` float32 or None), one native call: each thread widens four
    of its panels at a time to float32 (``q s + m``) in a scratch that stays in its cache and
    runs the FMA blocks on them. torch's int4 kernel takes a slow path with float32 rows
    (SmolLM2's 576 -> 1536 layer: 648 us at one row, 40 ms at 64, against 22 us and 245 us for
    the bfloat16-held float32 layer). From ``library_from`` rows (default
    ``INT4_LIBRARY_FROM_ROWS``) the weights are widened once to a plain float32 matrix for
    oneDNN's product instead (:func:`int4_widened`; not one native call: no call list records
    it). ``rows`` ``[M, K]`` float32; ``out``: where to write."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if rows.dim() == 2 and rows.shape[0] >= (library_from or INT4_LIBRARY_FROM_ROWS):  # many rows: oneDNN's product on the weights widened once
        y = float32_product(rows, int4_widened(packed, scales, group, extra_flags), bias)
        return y if out is None else product_output(rows, n, out, "int4_product").copy_(y)
    return widened_product(load_int4(extra_flags), rows, packed, scales, n, k, group, bias, out=out)


def int4_widened(packed: torch.Tensor, scales: torch.Tensor | FileScales, group: int, extra_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """int4 weights (as :func:`int4_product` takes them) as a plain float32 ``[N, K]`` view of the
    shared scratch, each weight ``q s + m`` as the panels widen it."""
    n, k = packed.shape[0], packed.shape[1] * 2
    plain = _scratch_matrix(n * k).view(n, k)
    pairs, kind, outer, per_block = scale_args(scales)
    widen = widen_entry("modserve_avx2_int4_widen_plain", INT4_WIDEN_ARGS, extra_flags)
    widen(packed.data_ptr(), pairs, n, k, group, kind, outer, per_block, plain.data_ptr(), torch.get_num_threads())
    return plain


def _scratch_matrix(numel: int) -> torch.Tensor:
    """The first ``numel`` floats of this thread's widening scratch (grown as needed)."""
    matrix = getattr(_scratch, "matrix", None)
    if matrix is None or matrix.numel() < numel:
        matrix = _scratch.matrix = torch.empty(numel, dtype=torch.float32)
    return matrix[:numel]


@functools.cache
def widen_entry(symbol: str, argtypes: tuple, extra_flags: tuple[str, ...] = ()) -> ctypes._CFuncPtr:
    """One of the kernel library's widenings to a plain float32 matrix as a ctypes function:
    ``modserve_avx2_widen`` (packed bfloat16 panels, :data:`WIDEN_ARGS`) or
    ``modserve_avx2_int4_widen_plain`` (int4 weights, :data:`INT4_WIDEN_ARGS`); never in a call
    list: only products of many rows use them."""
    load(extra_flags)  # built, and available on this CPU
    widen = getattr(compile_and_load(SOURCE, "the AVX2 linear kernel", extra_flags), symbol)
    widen.argtypes, widen.restype = list(argtypes), None
    return widen


@functools.cache
def load_codes(extra_flags: tuple[str, ...] = ()) -> NativeFunction:
    """The same kernel's entry over int8 codes (:class:`~modserve.plugins.platforms.cpu_int8_panel_linear.Int8PanelLinear`)."""
    return load_int8(SOURCE, "the AVX2 linear kernel", "modserve_avx2_linear_int8", "AVX2 and FMA", extra_flags)


def exact_in_bfloat16(weight: torch.Tensor) -> bool:
    """Whether every value of ``weight`` survives a round trip through bfloat16."""
    w = weight.detach()
    return w.dtype == torch.bfloat16 or bool(torch.equal(w.to(torch.bfloat16).to(w.dtype), w))


class Avx2Linear(PanelLinear):
    """``y = x @ W.T + b`` for float32 ``x`` with ``W`` held as bfloat16 panels (rounded there:
    the platform builds one only for weights :func:`exact_in_bfloat16`); gated on request
    (:class:`PanelLinear`: ``silu(gate) * up`` in float32)."""

    dtype = torch.float32

    def __init__(self, linear: nn.Linear, library_from_rows: int = LIBRARY_FROM_ROWS) -> None:
        super().__init__(linear, load())
        self.library_from_rows = library_from_rows  # rows from which a plain layer widens for oneDNN's product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        if self.gated or x.dtype != self.dtype or x.shape[-1] != k or x.numel() < self.library_from_rows * k:
            return super().forward(x)  # (which also refuses what it must)
        y = float32_product(x.reshape(-1, k), self._widened(), self._buffers["_bias32"])
        return y.view(*x.shape[:-1], self.out_features)

    def _widened(self) -> torch.Tensor:
        """This layer's weights as a plain float32 ``[out_features, in_features]`` view of the
        shared scratch, widened from its panels (rows in the panels' order)."""
        packed = self._buffers["packed"]
        panels, k_padded = packed.shape[0], packed.shape[1] * 32
        plain = _scratch_matrix(panels * 16 * k_padded).view(panels * 16, k_padded)
        widen = widen_entry("modserve_avx2_widen", WIDEN_ARGS)
        widen(packed.data_ptr(), self.out_features, k_padded, plain.data_ptr(), torch.get_num_threads())
        return plain[: self.out_features, : self.in_features]
