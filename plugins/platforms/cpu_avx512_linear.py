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

from torch import nn

from modserve.core.contract import NativeFunction
from modserve.native.build import SOURCES
from modserve.plugins.platforms.cpu_int8_panel_linear import load_int8
from modserve.plugins.platforms.cpu_panel_linear import PanelLinear, load_kernel

SOURCE = SOURCES / "cpu_avx512_linear.cpp"


@functools.cache
def load() -> NativeFunction:
    """The compiled kernel; raises ``KernelUnavailable`` where it cannot be built, or where the
    compiler does not target AVX512_BF16 on this CPU (``-march=native``)."""
    return load_kernel(SOURCE, "the AVX512_BF16 linear kernel", "modserve_avx512_linear", "AVX512_BF16")


@functools.cache
def load_codes() -> NativeFunction:
    """The same kernel's entry over int8 codes (:class:`~modserve.plugins.platforms.cpu_int8_panel_linear.Int8PanelLinear`)."""
    return load_int8(SOURCE, "the AVX512_BF16 linear kernel", "modserve_avx512_linear_int8", "AVX512_BF16")


class Avx512Linear(PanelLinear):
    """``y = x @ W.T + b`` for bfloat16 ``x`` by VDPBF16PS over packed panels (any K, no
    padding of the rows); gated on request (:class:`PanelLinear`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, load())
