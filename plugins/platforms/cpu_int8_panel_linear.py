"""int8 weight-only linear layers (``device.quantization: int8``) on the panel kernels: the codes
held in the panels' layout and widened in registers, the channel scales applied to the float32
sums, ``y = (x @ q.T) * scale + b`` rounded once to the model's dtype. Also the kernels' entries
for codes with a scale (and a zero) per group of inputs (GGUF Q8_0, Q6_K, Q5_x, K-quant mixes,
GPTQ 8-bit: :func:`group_int8_kernel`).

Why: on CPUs whose float linears run on our panel kernels (AVX512_BF16 without AMX, and float32
on AVX2 / AVX-512), the ``int8`` scheme ran torch's products (:class:`~modserve.plugins.platforms.cpu_quant.Int8WeightOnlyLinear`:
``_weight_int8pack_mm`` below 16 rows, widened weights above), which a decode call list cannot
record, so an int8 model ran every step eagerly. Here a layer is one kernel call reading half the
bytes of bfloat16 panels, recordable as the float layers are, and gated on request
(:class:`~modserve.plugins.platforms.cpu_panel_linear.PanelLinear`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.contract import NativeFunction
from modserve.native.build import SOURCES
from modserve.plugins.platforms.cpu_group_panels import GROUP_INT8_ARGS
from modserve.plugins.platforms.cpu_panel_linear import PANEL_ARGS, TILE_N, PanelLinear, gated_pairs, load_kernel, pack_tiles
from modserve.plugins.platforms.cpu_quant import quantize_per_channel_int8

INT8_ARGS = [*PANEL_ARGS, ctypes.c_void_p]  # a panel linear's, then the codes' channel scales
GROUP_BUILDS = {  # (the model's dtype, codes below 128): the source, symbol and instructions of its group-scaled int8 entry
    (torch.bfloat16, False): ("cpu_avx512_linear.cpp", "modserve_avx512_linear_group_int8", "AVX512_BF16"),
    (torch.bfloat16, True): ("cpu_avx512_linear.cpp", "modserve_avx512_linear_group_u7", "AVX512_BF16"),
    (torch.float32, False): ("cpu_avx2_linear.cpp", "modserve_avx2_linear_group_int8", "AVX2 and FMA"),
    (torch.float32, True): ("cpu_avx2_linear.cpp", "modserve_avx2_linear_group_int8", "AVX2 and FMA"),  # widened: q d + m either way
}


def load_int8(source, what: str, symbol: str, instructions: str, extra_flags: tuple[str, ...] = ()) -> NativeFunction:
    """A panel kernel's int8 entry (``symbol``, in ``source`` beside the float one)."""
    return load_kernel(source, what, symbol, instructions, extra_flags, INT8_ARGS)


@functools.cache
def group_int8_kernel(dtype: torch.dtype, extra_flags: tuple[str, ...] = (), below_128: bool = False) -> NativeFunction:
    """The panel kernel's entry for int8 codes with group-wise scales and optional zeros, for a
    model of ``dtype``: each thread widens four panels at a time (``q d + z`` in float32;
    bfloat16: rounded once) into a scratch and runs the panel blocks on them, or for few
    bfloat16 rows multiplies the codes directly (``native/group_int8_panels.h``). ``below_128``:
    unsigned codes below 128 with their minima as zeros, in bfloat16 multiplied directly at any
    row count, each code widened to the bfloat16 ``128 + q`` by an OR."""
    source, symbol, instructions = GROUP_BUILDS[dtype, below_128]
    return load_kernel(SOURCES / source, "the panel linear kernel", symbol, instructions, extra_flags, GROUP_INT8_ARGS)


class Int8PanelLinear(PanelLinear):
    """``y = (x @ q.T) * scale + b`` for ``x`` of ``dtype`` (bfloat16 on the AVX512_BF16 kernel,
    float32 on the AVX2 one): ``q`` the int8 codes of :func:`quantize_per_channel_int8` (or
    ``codes``: ``(q, scale)`` already quantized), packed as panels; the scales in float32, in
    the panels' order."""

    def __init__(self, linear: nn.Linear, kernel: NativeFunction, dtype: torch.dtype,
                 codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.dtype = dtype
        self._codes = codes
        super().__init__(linear, kernel)
        del self._codes

    def _pack(self, linear: nn.Linear) -> torch.Tensor:
        q, scale = self._codes if self._codes is not None else quantize_per_channel_int8(linear.weight)  # codes: no float weight read
        self._set_scale(F.pad(scale.float(), (0, -scale.shape[0] % TILE_N)))
        return pack_tiles(q)

    def _set_scale(self, scale: torch.Tensor) -> None:
        self.register_buffer("scale", scale.contiguous(), False)
        self._extra = (self.scale.data_ptr(),)

    def enable_silu_mul(self) -> bool:
        was = self.gated
        if super().enable_silu_mul() and not was:  # the scales follow their panels
            self._set_scale(gated_pairs(self.scale.view(-1, TILE_N)).reshape(-1))
        return self.gated

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8"
