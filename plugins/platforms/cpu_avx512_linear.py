"""bfloat16 linear layers on AVX512_BF16 (VDPBF16PS), for CPUs that have it but no AMX (AMD
Zen 4 / Zen 5, Intel Cooper Lake).

Why not oneDNN's packed product (:mod:`cpu_linear`): on a Zen 5 (2 cores) it ran SmolLM2's 30
layers at 8.2-9.7 ms for one row, where reading the weights takes 6.0 ms, and at 43-64 rows (a
decode step at 64 clients) at 460-560 GFLOP/s, where from 256 rows it reaches 870-900: a call
costs ~20 us before its first product, rows are padded to one of 39 shapes, and its small-row
kernels leave the FMA units waiting on memory. ``native/cpu_avx512_linear.cpp`` is one ctypes
call and one OpenMP region; each group of four panels stays in L2 while every six-row block
runs all of K with its 24 sums in registers, and the blocks after the first ask for the next
group's weights ahead. Measured against oneDNN in one run (``benchmarks/cpu_linears.py``):
1 row 1.41x, 16 rows 1.29x, 43 rows 1.60x, 64 rows 1.38x, 512 rows 1.06x (docs/cpu_linears.md).

The weights are packed as :mod:`cpu_panel_linear` holds them (the AMX kernel's layout), the
same bytes as oneDNN's copy. Results equal ``F.linear`` up to float32 summation order.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from modserve.core.contract import NativeFunction
from modserve.native.build import SOURCES
from modserve.plugins.platforms.cpu_int8_panel_linear import load_int8
from modserve.plugins.platforms.cpu_int4_scales import FileScales
from modserve.plugins.platforms.cpu_panel_linear import WIDENED_ARGS, PanelLinear, load_kernel, widened_product

SOURCE = SOURCES / "cpu_avx512_linear.cpp"


@functools.cache
def load() -> NativeFunction:
    """The compiled kernel; raises ``KernelUnavailable`` where it cannot be built, or where the
    compiler does not target AVX512_BF16 on this CPU (``-march=native``)."""
    return load_kernel(SOURCE, "the AVX512_BF16 linear kernel", "modserve_avx512_linear", "AVX512_BF16")


@functools.cache
def load_int4() -> NativeFunction:
    """The same kernel's entry over int4 weights as torch's int4 kernel holds them, widened to
    bfloat16 panels per call (:func:`int4_product`)."""
    return load_kernel(SOURCE, "the AVX512_BF16 linear kernel", "modserve_avx512_linear_int4", "AVX512_BF16", argtypes=WIDENED_ARGS)


def int4_product(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor | FileScales, group: int,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows @ W.T + bias`` in bfloat16 for int4 ``W`` held as torch's CPU int4 kernel holds it on AVX-512
    (``packed`` from :func:`~modserve.plugins.platforms.cpu_int4_packing.pack_int4`, ``[N, K/2]`` uint8, N a multiple
    of 64; ``scales`` torch's ``scales_and_zeros`` ``[K/group, N, 2]`` bfloat16, or a GGUF
    layer's own (:class:`FileScales`: ``q s + m``, exact); K and the group multiples of 32;
    ``bias`` ``[N]`` float32 or None), one native call (``native/int4_panels.h``): below 8 rows
    each thread multiplies its 64-output blocks' nibbles directly (the weights never rounded);
    from 8 rows on it widens four of its panels at a time to bfloat16 (``q s + (z - 8 s)``,
    rounded once, as the AMX tiles' widening) in a scratch that stays in its cache and
    multiplies them with VDPBF16PS. ``rows`` ``[M, K]`` bfloat16; ``out``: where to write (widened_product)."""
    return widened_product(load_int4(), rows, packed, scales, packed.shape[0], packed.shape[1] * 2, group, bias, out=out)


@functools.cache
def load_codes() -> NativeFunction:
    """The same kernel's entry over int8 codes (:class:`~modserve.plugins.platforms.cpu_int8_panel_linear.Int8PanelLinear`)."""
    return load_int8(SOURCE, "the AVX512_BF16 linear kernel", "modserve_avx512_linear_int8", "AVX512_BF16")


class Avx512Linear(PanelLinear):
    """``y = x @ W.T + b`` for bfloat16 ``x`` by VDPBF16PS over packed panels (any K, no
    padding of the rows); gated on request (:class:`PanelLinear`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, load())
