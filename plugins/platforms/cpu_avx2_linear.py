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

SOURCE = SOURCES / "cpu_avx2_linear.cpp"


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
                 bias: torch.Tensor | None = None, extra_flags: tuple[str, ...] = (), out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows @ W.T + bias`` in float32 for int4 ``W`` held as torch's CPU int4 kernel holds it
    (``packed`` ``[N, K/2]`` uint8, N a multiple of 64; ``scales`` torch's ``scales_and_zeros``
    ``[K/group, N, 2]`` float32, or the file's own (:class:`FileScales`); K and the group
    multiples of 32; ``bias`` ``[N]`` float32 or None), one native call: each thread widens four
    of its panels at a time to float32 (``q s + m``) in a scratch that stays in its cache and
    runs the FMA blocks on them. torch's int4 kernel takes a slow path with float32 rows
    (SmolLM2's 576 -> 1536 layer: 648 us at one row, 40 ms at 64, against 22 us and 245 us for
    the bfloat16-held float32 layer). ``rows`` ``[M, K]`` float32; ``out``: where to write."""
    n, k = packed.shape[0], packed.shape[1] * 2
    return widened_product(load_int4(extra_flags), rows, packed, scales, n, k, group, bias, out=out)


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

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, load())
