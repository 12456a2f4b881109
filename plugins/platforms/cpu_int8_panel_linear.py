"""int8 weight-only linear layers (``device.quantization: int8``) on the panel kernels: the codes
held in the panels' layout and widened in registers, the channel scales applied to the float32
sums, ``y = (x @ q.T) * scale + b`` rounded once to the model's dtype.

Why: on CPUs whose float linears run on our panel kernels (AVX512_BF16 without AMX, and float32
on AVX2 / AVX-512), the ``int8`` scheme ran torch's products (:class:`~modserve.plugins.platforms.cpu_quant.Int8WeightOnlyLinear`:
``_weight_int8pack_mm`` below 16 rows, widened weights above), which a decode call list cannot
record, so an int8 model ran every step eagerly. Here a layer is one kernel call reading half the
bytes of bfloat16 panels, recordable as the float layers are, and gated on request
(:class:`~modserve.plugins.platforms.cpu_panel_linear.PanelLinear`).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.contract import NativeFunction
from modserve.plugins.platforms.cpu_panel_linear import PANEL_ARGS, TILE_N, PanelLinear, gated_pairs, load_kernel, pack_tiles
from modserve.plugins.platforms.cpu_quant import quantize_per_channel_int8

INT8_ARGS = [*PANEL_ARGS, ctypes.c_void_p]  # a panel linear's, then the codes' channel scales


def load_int8(source, what: str, symbol: str, instructions: str, extra_flags: tuple[str, ...] = ()) -> NativeFunction:
    """A panel kernel's int8 entry (``symbol``, in ``source`` beside the float one)."""
    return load_kernel(source, what, symbol, instructions, extra_flags, INT8_ARGS)


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
