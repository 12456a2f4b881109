"""Weight-quantized linear layers for the ``cpu`` platform (``device: {plugin: cpu, quantization: ...}``).

Three schemes, one small module each, built from a loaded ``nn.Linear`` (weights already in
the model dtype) by :func:`quantize_linear`. Every module computes ``y = x @ W.T + b`` for
``x`` of shape ``[..., in]`` (the model passes flat ``[T, in]`` token rows; ``T`` may be 0),
returns the input's dtype, and holds only its quantized tensors and the bias: the float
weight is not referenced, so it is freed once the model drops the ``nn.Linear``.

- ``int8`` (:class:`Int8WeightOnlyLinear`): int8 weights, one symmetric scale per output
  channel, ``torch._weight_int8pack_mm`` (dequantizes inside the kernel, activations stay
  float). Half of bfloat16's weight memory, a quarter of float32's.
- ``w8a8`` (:class:`W8A8Linear`): int8 weights per output channel and int8 activations,
  quantized per token (each row's absmax) at every call; int8 x int8 products with int32
  accumulation through oneDNN (``torch.ops.onednn.qlinear_pointwise`` on weights reordered
  once by ``onednn.qlinear_prepack``: VNNI / AMX-INT8 where the CPU has them), the per-row
  activation scale applied to the output afterwards; bfloat16 models on AMX CPUs instead take
  :mod:`cpu_amx_int8`, one call that quantizes, multiplies and scales (3-5x faster).
- ``int4`` (:class:`Int4WeightOnlyLinear`): 4-bit weights, asymmetric (a scale and a zero
  per group of ``group_size`` inputs of each output channel), torch's CPU int4 kernels
  ``torch._convert_weight_to_int4pack_for_cpu`` / ``torch._weight_int4pack_mm_for_cpu``.
  A quarter of bfloat16's weight memory (plus the group scales).

On AMX CPUs, bfloat16 ``int8`` and ``int4`` layers (int4 from 8 rows) widen their codes to
bfloat16 tiles per call and multiply on them (:mod:`cpu_amx_linear`), and ``w8a8`` layers
run on AMX-INT8 tiles (:mod:`cpu_amx_int8`); the platform decides (``amx``).
- ``gguf`` (:func:`gguf_linear`): a GGUF file's blocks kept as they are, built from the
  loader's :class:`~modserve.core.models.kept_weights.KeptLinear` without a float weight:
  Q4_0 / Q4_1 / Q4_K as ``int4`` with groups of 32 (:meth:`Int4WeightOnlyLinear.from_codes`,
  exact), Q8_0, Q6_K, the 5-bit formats and mixed layers as :class:`Int8GroupLinear`.

Why these ops. Micro-timing, machine busy (torch 2.13 CPU wheel, 2 cores of a Xeon with
AMX-INT8/AVX512-VNNI, other jobs running; best of 10-40 calls in one process: relative
figures for choosing, not reported results). One [T, 576] x [576 -> 1536] product (a
SmolLM2 MLP shape), T = 1 / 16 / 64 / 256 rows, whole modules, microseconds:

    bfloat16: PackedLinear (AMX-BF16)  41 /   30 /    60 /    148
              int8 (int8pack_mm)       28 /  170 /   644 /   2648
              w8a8 (oneDNN)            64 /   89 /   129 /    337   (the _int_mm variant: 78 / 100 / 136 / 440)
              int4 (group 64)          27 /  158 /   595 /   2410
    float32:  PackedLinear             77 /  108 /   324 /   1048
              int8                    247 / 3596 / 14463 /  57457
              w8a8                     64 /   75 /   117 /    314
              int4                    658 / 10383 / 41416 / 164902

- W8A8. ``torch._int_mm`` runs on the CPU (exact int32, any row count) but takes the int8
  weight as a plain matrix each call: 48 / 42 / 192 us for the bare GEMM at T = 16 / 64 /
  256, against 27 / 40 / 77 us for ``onednn.qlinear_pointwise`` on a weight prepacked once,
  which is also what PyTorch inductor's x86 quantizer lowers int8 linears to (kept, AMX-INT8
  capable). Its limit: the activation scale is one number per call (oneDNN refuses a per-row
  ``x_scale``: "act scale/zp size should be 1"). So the GEMM runs with ``x_scale = 1`` and
  the per-channel weight scales fused, writing the model dtype, and the per-row scales
  multiply the output in place; with a single row (one request decoding) its scale and the
  bias go into the call itself. The activation quantization is plain torch (absmax,
  multiply, round, cast: 23 / 39 / 82 us, as long as the GEMM or longer) and the largest
  part of the cost; vLLM's CPU backend has its own compiled fused quantize kernel and
  oneDNN matmul handler for this, which torch does not expose. torchao is not used: it is
  not installed here, and its CPU int8 dynamic-activation path lowers to this same oneDNN op
  (through inductor), a dependency for the same kernel. Net: W8A8 beats float32 by 1.2-3.3x
  and halves bfloat16's weight memory, but is 1.5-3x slower than AMX bfloat16 at these
  small shapes.
- int8 weight-only: ``_weight_int8pack_mm`` (torch's int8 weight-only kernel, float
  activations; the one the design names). A matrix-vector product reading half the bytes, it beats
  bfloat16 at one row (a single request decoding) and loses badly from 16 rows on; with
  float32 activations this build runs a far slower path. It saves memory, not time.
- int4: ``_weight_int4pack_mm_for_cpu``, torch's group-wise int4 weight-only CPU kernel.
  Same shape of trade as int8: fastest at one row, slow in batches, very slow in float32.

oneDNN builds and keeps a primitive per input shape (0.35 MB each: a ``qlinear_pointwise``
called with every row count from 1 to 1000 grew RSS by 370 MB), so W8A8 pads its int8 rows
to :func:`~modserve.plugins.platforms.cpu_linear.row_chunks`' fixed set of sizes, as
:class:`~modserve.plugins.platforms.cpu_linear.PackedLinear` does. The two ATen kernels
build nothing per shape and take the rows as they come.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.config import ConfigError
from modserve.core.contract import NativeFunction
from modserve.plugins.platforms.cpu_int4_packing import for_torch, pack_int4
from modserve.plugins.platforms.cpu_linear import _CHUNK_SIZES, _padded, linear_product, row_chunks

if TYPE_CHECKING:
    from modserve.core.models.gguf_quantized import TwoLevelScales
    from modserve.plugins.platforms.cpu_group_panels import GroupLayout
    from modserve.plugins.platforms.cpu_int4_scales import FileScales

log = logging.getLogger("modserve.platform")

SCHEMES = ("none", "int8", "w8a8", "int4")  # quantized here from float weights; "gguf" keeps a file's blocks (gguf_linear)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs output channels in 16s


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(q [N, K] int8 in [-127, 127], scale [N] float32)``, ``w ≈ q * scale``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row (token): ``(q [M, K] int8, scale [M, 1] float32)``, ``x ≈ q * scale``.

    ``|x * 127 / absmax| <= 127`` up to float rounding, so no clamp; an all-zero row gets the
    smallest positive scale and quantizes to zeros."""
    absmax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=torch.finfo(torch.float32).tiny)
    q = (x * (127.0 / absmax)).round_().to(torch.int8)
    return q, absmax.mul_(1.0 / 127.0)


DEQUANTIZE_FROM_ROWS = 16  # int8 weight-only: from this many rows on (always in float32), widen the weights per call
AMX_INT4_FROM_ROWS = 8  # int4 on AMX CPUs: from this many bfloat16 rows on, widen to bfloat16 tiles per call
PANEL_DTYPES = (torch.bfloat16, torch.float32)  # the panel kernels' rows: bfloat16 (AVX512_BF16) or float32 (AVX2)


class QuantizedLinear(nn.Module):
    """What every quantized linear shares: the layer's shape and bias, rows flattened for one
    ``product`` (which adds the bias) and put back in the input's shape, no call for no rows.
    ``input_order``: the order the stored weight's inputs are in, where it is not the layer's
    (a GPTQ act-order checkpoint's groups): each call gathers the activations in it."""

    records = False  # every call one native call (no torch operator): a decode call list can replay it

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bias = layer.bias
        self.register_buffer("input_order", None, False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [M, K]`` (M >= 1) times the weight, plus the bias: ``[M, N]``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.input_order is not None:
            rows = rows.index_select(1, self.input_order)
        return self.product(rows).view(*x.shape[:-1], self.out_features)

    def with_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out.add_(self.bias)

    def product_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """:meth:`product` written into ``out`` (``[M, N]``, any row stride: columns of a wider
        output) by the one native call of a module that :attr:`records`."""
        raise TypeError(f"{type(self).__name__} writes no output in place")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8WeightOnlyLinear(QuantizedLinear):
    """``y = x @ (q * scale).T + b``: int8 weights, a symmetric scale per output channel.

    Two products, by what is faster (micro-timing, [T, 576] x [576 -> 1536], AMX Xeon, quiet):
    below ``DEQUANTIZE_FROM_ROWS`` bf16/fp16 rows, ``torch._weight_int8pack_mm``, which reads
    the int8 weights once (4 rows 43 us); from there on, and always in float32 (where that
    kernel takes a slow path: 246 us for one row), the weights are widened to the activations'
    dtype for one product (:func:`~modserve.plugins.platforms.cpu_linear.linear_product`) and
    the channel scales multiply its output, ``(x @ q.T) * scale``
    (bf16: 16 rows 149 us against 163, 64 rows 192 against 686, 256 rows 377 against 2750;
    float32: 1 row 93 us against 246, 64 rows 577 against 14429). The widened copy lives for
    one call: memory stays the int8 weights'.

    The kernel takes the scales in the activations' dtype; they are kept in the layer's.
    ``amx`` (bfloat16 models where the platform's linears run on AMX tiles, K a multiple of 32):
    every call instead widens the int8 codes (held in the tiles' order) to bfloat16 tiles,
    exactly, thread by thread, and runs the AMX product with the channel scales and the bias
    applied to its float32 sums (:func:`~modserve.plugins.platforms.cpu_amx_linear.int8_product`).
    ``codes``: ``(q [N, K] int8, scale [N])`` already quantized (a pre-quantized checkpoint's),
    with ``dtype`` the model's."""

    def __init__(self, layer: nn.Linear, codes: tuple[torch.Tensor, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
                 amx: bool = False) -> None:
        super().__init__(layer)
        q, scale = codes if codes is not None else quantize_per_channel_int8(layer.weight)
        self.register_buffer("scale", scale.to(dtype or layer.weight.dtype), False)
        self.amx = amx and self.in_features % 32 == 0
        if self.amx:  # bfloat16 rows on AMX tiles: int8 codes in the tiles' order, widened per call
            from modserve.plugins.platforms import cpu_amx_linear, cpu_panel_linear

            self._amx_product = cpu_amx_linear.int8_product
            self.register_buffer("amx_packed", cpu_panel_linear.pack_tiles(q), False)
            self.register_buffer("_scale32", scale.float().contiguous(), False)  # not rounded to the model dtype
            self.register_buffer("_bias32", None if self.bias is None else self.bias.detach().float().contiguous(), False)
        else:
            self.register_buffer("qweight", q, False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.amx:
            if rows.dtype != torch.bfloat16:
                raise TypeError(f"Int8WeightOnlyLinear on AMX tiles takes bfloat16 rows, got {rows.dtype}")
            return self._amx_product(rows, self.amx_packed, self._scale32, self._bias32, self.out_features)
        scale = self.scale if self.scale.dtype == rows.dtype else self.scale.to(rows.dtype)
        if rows.shape[0] >= DEQUANTIZE_FROM_ROWS or rows.dtype == torch.float32:
            out = linear_product(rows, self.qweight.to(rows.dtype)).mul_(scale)  # int8 values are exact in bf16
        else:
            out = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, scale)
        return self.with_bias(out)


@functools.cache
def onednn_int8_available() -> bool:
    """Whether this torch build and CPU run oneDNN's int8 linear exactly (x86 with mkldnn;
    probed once). Without AVX512_VNNI or AVX-VNNI, oneDNN sums pairs of u8 x s8 products in
    int16, which saturates: on an AVX2-only Zen 3, rows of 127 times weights of 127 over 16
    inputs gave 2,040 instead of 258,064. The probe multiplies exactly such values, so those
    CPUs take ``torch._int_mm`` (exact int32 sums)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        packed = torch.ops.onednn.qlinear_prepack(torch.full((16, 16), 127, dtype=torch.int8), None)
        out = torch.ops.onednn.qlinear_pointwise.default(torch.full((4, 16), 127, dtype=torch.int8), 1.0, 0, packed, torch.ones(16),
                                                         torch.zeros(16, dtype=torch.long), None, 1.0, 0, torch.float32, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool((out == 16 * 127 * 127).all())


class W8A8Linear(QuantizedLinear):
    """``y = (s_x * q_x) @ (q_w * s_w).T + b``: int8 weights (a symmetric scale per output
    channel) times int8 activations (a symmetric scale per row, computed at every call),
    int32 accumulation.

    ``amx`` (bfloat16 models where the platform's linears run on AMX tiles): one call of
    :mod:`cpu_amx_int8` quantizes the rows, multiplies on AMX-INT8 tiles and applies the scales
    and bias. Else oneDNN (``onednn.qlinear_pointwise``, weights prepacked once) where this
    torch can, else ``torch._int_mm`` (a plain int8 matrix product) with the scales applied in
    float32. ``codes``: ``(q [N, K] int8, scale [N])`` already quantized (a pre-quantized
    checkpoint's).
    """

    def __init__(self, layer: nn.Linear, use_onednn: bool | None = None, codes: tuple[torch.Tensor, torch.Tensor] | None = None,
                 amx: bool = False) -> None:
        super().__init__(layer)
        q, scale = codes if codes is not None else quantize_per_channel_int8(layer.weight)
        self.amx = amx
        self.onednn = not amx and (onednn_int8_available() if use_onednn is None else use_onednn)
        if amx:  # bfloat16 rows on AMX-INT8 tiles, quantized inside the call (cpu_amx_int8)
            from modserve.plugins.platforms import cpu_amx_int8

            self._amx_product = cpu_amx_int8.w8a8_product
            self.register_buffer("amx_packed", cpu_amx_int8.pack(q), False)
            self.register_buffer("_bias32", None if self.bias is None else self.bias.detach().float().contiguous(), False)
        elif self.onednn:  # the op is looked up here: a torch build without it still imports this module
            self._qlinear = torch.ops.onednn.qlinear_pointwise.default
            self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(q, None), False)
            self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.long), False)
        else:
            self.register_buffer("qweight_t", q.t(), False)  # [K, N], column-major: _int_mm's mat2
        self.register_buffer("scale", scale.float(), False)  # float32: oneDNN's weight scales are float32

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        m, dtype = rows.shape[0], rows.dtype
        if self.amx:
            if dtype != torch.bfloat16:
                raise TypeError(f"W8A8Linear on AMX tiles takes bfloat16 rows, got {dtype}")
            return self._amx_product(rows, self.amx_packed, self.scale, self._bias32, self.out_features)
        q, row_scale = quantize_rows_int8(rows)
        if not self.onednn:
            return self.with_bias(torch._int_mm(q, self.qweight_t).float().mul_(row_scale).mul_(self.scale).to(dtype))
        if m == 1:  # one token: its scale is the tensor's, so the scale and the bias fuse into the call
            return self._gemm(q, row_scale.item(), self.bias, dtype)
        parts = [self._gemm(q[start : start + size], 1.0, None, dtype) for start, size in row_chunks(m)]
        return self.with_bias((parts[0] if len(parts) == 1 else torch.cat(parts)).mul_(row_scale.to(dtype)))

    def _gemm(self, q: torch.Tensor, x_scale: float, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """One oneDNN call, the rows padded with zeros to a size from the fixed set (module doc)."""
        rows = q.shape[0]
        if rows != 1 and rows not in _CHUNK_SIZES:  # one row (a lone decode step) is one more shape, not padded to 4
            q = F.pad(q, (0, 0, 0, _padded(rows) - rows))
        out = self._qlinear(q, x_scale, 0, self.packed, self.scale, self.zero_points, bias, 1.0, 0, dtype, "none", [], "")
        return out[:rows]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={'amx' if self.amx else 'onednn' if self.onednn else 'int_mm'}"


def int4_group_size(name: str, in_features: int, out_features: int, wanted: int) -> int:
    """The group size for one layer: ``wanted``, or the largest smaller supported size that
    divides ``in_features`` (SmolLM2's 576 takes 64 where 128 is asked); a config error naming
    the layer where none does, or where the kernel cannot pack ``out_features``."""
    if out_features % INT4_N_MULTIPLE:
        raise ConfigError(
            f"device.quantization: int4 needs out_features to be a multiple of {INT4_N_MULTIPLE}; "
            f"layer {name!r} has {out_features}: use int8 or w8a8"
        )
    fits = [g for g in INT4_GROUP_SIZES if g <= wanted and in_features % g == 0]
    if not fits:
        raise ConfigError(
            f"device.int4_group_size: layer {name!r} has in_features {in_features}, divisible by none of "
            f"{', '.join(str(g) for g in INT4_GROUP_SIZES if g <= wanted)}; use int8 or w8a8"
        )
    return fits[-1]


def quantize_groups_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of ``group_size`` inputs: ``(q [N, K] int32 in [0, 15],
    scale [N, K/g] float32, minimum [N, K/g] float32)``, ``w ≈ q * scale + minimum``."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-6)
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    return q.view(n, k), scale, lo


class Int4WeightOnlyLinear(QuantizedLinear):
    """``y = x @ W.T + b`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` for
    ``g = k // group_size``: torch's CPU int4 kernel's own format (``scales_and_zeros`` is
    ``[K/g, N, 2]`` in the activations' dtype, ``zero = minimum + 8 * scale``), the 4-bit
    values packed two per byte as ``_convert_weight_to_int4pack_for_cpu`` packs them on an
    AVX-512 CPU, on every CPU (:mod:`~modserve.plugins.platforms.cpu_int4_packing`).

    That kernel is a matrix-vector product per row: the fastest at one row, 5-18x slower than
    bfloat16 from 16 rows on. With ``amx`` (set by the platform where its bfloat16 linears run
    on AMX tiles), from ``AMX_INT4_FROM_ROWS`` bfloat16 rows on and where ``out_features`` is a
    multiple of 64, each call widens the weights to bfloat16 tiles, thread by thread, and runs
    the AMX product on them (:func:`~modserve.plugins.platforms.cpu_amx_linear.int4_product`).
    With ``panels`` (set where the platform's linears of the module's dtype are our panel
    kernels) and ``out_features`` a multiple of 64, every call is one native call, the bias
    inside: bfloat16 on AVX512_BF16 (:func:`~modserve.plugins.platforms.cpu_avx512_linear.int4_product`:
    below 8 rows the nibbles multiplied directly, from 8 on the same widening into bfloat16
    panels), float32 on AVX2 (:func:`~modserve.plugins.platforms.cpu_avx2_linear.int4_product`:
    widened to float32 panels); such a layer is recordable in a decode call list (:attr:`records`)."""

    amx = False
    panels = False
    library_from_rows: int | None = None  # float32 rows from which a call on the panels takes oneDNN's product (None: the kernel's default; the platform sets it past its largest recorded decode batch)

    def __init__(self, layer: nn.Linear, group_size: int) -> None:
        super().__init__(layer)
        q, scale, lo = quantize_groups_int4(layer.weight, group_size)
        self._store(layer, q, scale, lo, group_size, layer.weight.dtype)

    @classmethod
    def from_codes(cls, layer: nn.Linear, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int,
                   dtype: torch.dtype, levels: TwoLevelScales | None = None) -> Int4WeightOnlyLinear:
        """The module for weights already in this form, ``w = q * scale + minimum`` (``q [N, K]``
        int32 in [0, 15], ``scale`` and ``minimum`` ``[N, K/g]``): GGUF Q4_0 / Q4_1 / Q4_K blocks
        (``levels``: Q4_K's two levels of the same scales and minima), packed without a float
        weight (``layer`` gives the shape and the bias). The scales are kept aside until
        :meth:`use_panels`, which may hold them as the file gave them
        (:mod:`~modserve.plugins.platforms.cpu_int4_scales`)."""
        module = cls.__new__(cls)
        QuantizedLinear.__init__(module, layer)
        module._store(layer, q, scale, minimum, group_size, dtype)
        if dtype in PANEL_DTYPES:
            module._file_source = (scale, minimum, levels)
        return module

    def _store(self, layer: nn.Linear, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> None:
        self.group_size = group_size
        self.register_buffer("packed", pack_int4(q), False)  # [N, K/2] uint8, the native kernels' layout on every CPU
        scales_and_zeros = torch.stack([scale, lo + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype), False)
        self.register_buffer("_bias32", None if layer.bias is None else layer.bias.detach().float().contiguous(), False)  # panels

    _file_source: tuple | None = None  # from_codes' (scale, minimum, levels), until use_panels decides
    _held: FileScales | None = None  # the file's own scales, held by the panels instead of scales_and_zeros

    def use_panels(self, on: bool = True) -> None:
        """Run every call of the module's dtype on the panel kernels (``on``; needs
        ``out_features`` a multiple of 64), or not. A GGUF layer on the panels then holds its
        file's own scales (float16 ``(s, m)``, or Q4_K's two levels: 1 or 0.75 bits a weight,
        exact) instead of torch's ``(s, z)`` pairs (float32: 2 bits; bfloat16: 1, rounded);
        rows of another dtype are refused."""
        self.panels = on
        source, self._file_source = self._file_source, None
        if not on or source is None or self.out_features % 64 or self.input_order is not None:
            return
        from modserve.plugins.platforms.cpu_int4_scales import file_scales

        if (file := file_scales(*source)) is not None:  # computed only here: not for layers off the panels (AMX CPUs)
            self.register_buffer("file_pairs", file.pairs, False)
            self.register_buffer("file_outer", file.outer, False)
            self._held_dtype, self.scales_and_zeros = self.scales_and_zeros.dtype, None
            self._held = file

    @property
    def scales_dtype(self) -> torch.dtype:
        return self._held_dtype if self._held is not None else self.scales_and_zeros.dtype

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self._held is not None:
            if rows.dtype != self._held_dtype:
                raise TypeError(f"Int4WeightOnlyLinear holding a GGUF file's scales takes {self._held_dtype} rows, got {rows.dtype}")
            return self._panel_product(rows)
        sz = self.scales_and_zeros if self.scales_and_zeros.dtype == rows.dtype else self.scales_and_zeros.to(rows.dtype)
        if self.amx and rows.shape[0] >= AMX_INT4_FROM_ROWS and rows.dtype == torch.bfloat16 and self.out_features % 64 == 0:
            from modserve.plugins.platforms.cpu_amx_linear import int4_product

            return self.with_bias(int4_product(rows, self.packed, sz, self.group_size))
        if self.panels and rows.dtype == self.scales_and_zeros.dtype in PANEL_DTYPES and self.out_features % 64 == 0:
            return self._panel_product(rows)
        return self.with_bias(torch._weight_int4pack_mm_for_cpu(rows.contiguous(), self.torch_packed(), self.group_size, sz))

    _torch_copy: torch.Tensor | None = None  # packed in torch's layout, where this CPU's differs (torch_packed)

    def torch_packed(self) -> torch.Tensor:
        """The weights as torch's int4 product reads them on this CPU: :attr:`packed` itself,
        or (AVX2-only CPUs, whose torch packs in blocks of 32) a copy made on the first call.
        A layer whose calls all take torch's product there (a bfloat16 model on an AVX2-only
        CPU, where no native bfloat16 kernel runs) so holds both: half its bfloat16 bytes."""
        if self._torch_copy is None:
            self._torch_copy = for_torch(self.packed)
        return self._torch_copy

    def product_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        if not self.records or rows.dtype != self.scales_dtype:
            raise TypeError(f"Int4WeightOnlyLinear writes in place only on the panel kernels, with {self.scales_dtype} rows")
        self._panel_product(rows, out)

    def _panel_product(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One native call on the panel kernels of ``rows``' dtype, the bias inside."""
        from modserve.plugins.platforms import cpu_avx2_linear, cpu_avx512_linear

        scales = self.scales_and_zeros if self._held is None else self._held
        if rows.dtype == torch.bfloat16:
            return cpu_avx512_linear.int4_product(rows, self.packed, scales, self.group_size, self._bias32, out=out)
        return cpu_avx2_linear.int4_product(rows, self.packed, scales, self.group_size, self._bias32, out=out,
                                            library_from=self.library_from_rows)

    @property
    def records(self) -> bool:
        """Whether a call is one native call for any row count (no torch operator): a decode
        step through it can be recorded as a call list."""
        return self.panels and self.out_features % 64 == 0 and self.input_order is None and self.scales_dtype in PANEL_DTYPES

    def extra_repr(self) -> str:
        held = "" if self._held is None else ", the file's scales: " + self._held.describe()
        return f"{super().extra_repr()}, group_size={self.group_size}" + held


class Int8GroupLinear(QuantizedLinear):
    """``y = x @ W.T + b`` with ``W[n, k] = q[n, k] * scale[n, k // group] (+ zero[n, k // group])``:
    int8 weights with a scale, and optionally a zero, per group of ``group`` inputs of each
    output channel. GGUF's Q8_0 (groups of 32, float16 scales) kept as it is; the 4- to 6-bit
    formats (Q6_K in groups of 16, Q5_x, Q4 parts of a mixed layer) with ``below_128``: the
    codes unsigned, as stored, ``zero`` their minimum, or for symmetric formats ``center`` (``W =
    (q - center) * scale``: no bytes for a zero), which the bfloat16 panel kernel widens by
    an OR (``native/group_int8_panels.h``'s ``magic_pair``) and multiplies directly up to 32
    rows; a fused layer with a Q8_0 part as codes centred to int8 with zeros (:func:`gguf_linear`).

    torch has no int8 kernel with group-wise scales (``_weight_int8pack_mm`` takes one scale
    per output channel), and re-quantizing Q8_0 per channel would lose up to half a step of
    the row's coarsest group in every weight. So the weights are widened per call, in float32
    (``q * d``, the exact value llama.cpp's and gguf's dequantization give), cast to the
    activations' dtype for one product (``linear_product``): exact against the dequantized
    model, at the cost of one widening pass over the weight per call (the same trade as the
    int8 scheme's many-row path). The widened copy lives for one call; memory stays ``K + 2 K / 32`` bytes
    per output channel (a quarter of float32's, plus 6%)."""

    def __init__(self, layer: nn.Linear, q: torch.Tensor, scale: torch.Tensor, group: int = 32,
                 scale_dtype: torch.dtype = torch.float16, zero: torch.Tensor | None = None, below_128: bool = False,
                 center: int = 0, levels: TwoLevelScales | None = None) -> None:
        super().__init__(layer)
        if below_128 and ((zero is None) == (center == 0) or q.min() < 0):
            raise ValueError("Int8GroupLinear: codes below 128 are unsigned, with their minima as zeros or a center (not both)")
        self.group, self.below_128, self.center = group, below_128, center
        self._levels = levels  # the same scales (and zeros) in two levels: what the group panels hold, when they take them
        self.register_buffer("qweight", q.view(self.out_features, -1, group), False)  # [N, K/g, g] int8
        self.register_buffer("scale", scale.to(scale_dtype)[..., None], False)  # Q8_0's and GPTQ's float16 scales: exact
        self.register_buffer("zero", None if zero is None else zero.float()[..., None], False)  # [N, K/g, 1] float32

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight ``[N, K]`` in ``dtype`` (computed in float32, then cast)."""
        w = self.qweight.float()
        if self.center:
            w.sub_(self.center)
        w.mul_(self.scale.float())
        if self.zero is not None:
            w.add_(self.zero)
        w = w.view(self.out_features, self.in_features)
        return w if dtype == torch.float32 else w.to(dtype)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:
            return self._panel_product(rows)
        return linear_product(rows, self.weight_as(rows.dtype), self.bias)

    _panels: NativeFunction | None = None  # the panel kernel's entry, once use_panels took it
    _layout: GroupLayout | None = None  # how the group panels hold the layer

    def use_panels(self, kernel: NativeFunction, dtype: torch.dtype) -> bool:
        """Hold the codes as group panels (each group's codes in the panel kernels' order, codes
        below 64 in groups of up to 32 in 6 bits each, then the group's scales and zeros in as
        few bytes as hold them exactly: :func:`~modserve.plugins.platforms.cpu_group_panels.group_panels`), and run every call of
        ``dtype`` rows on ``kernel``
        (:func:`~modserve.plugins.platforms.cpu_int8_panel_linear.group_int8_kernel`): one
        native call, recordable, instead of the whole weight widened in torch per call (171 us
        against 14 us for bfloat16 panels at one row of a 576 -> 1536 layer). Needs N a multiple
        of 16, K a multiple of 32 and the group of 16; returns whether it took it."""
        n, k = self.out_features, self.in_features
        if n % 16 or k % 32 or self.group % 16 or self.input_order is not None:
            return False
        from modserve.plugins.platforms.cpu_group_panels import PACKED_GROUP_MAX, group_panels

        zeros = None if self.zero is None else self.zero.view(n, -1)
        packed = self.below_128 and self.group <= PACKED_GROUP_MAX and int(self.qweight.max()) < 64  # 6 bits suffice
        held, self._layout = group_panels(self.qweight.view(n, k), self.scale.view(n, -1), zeros, self.group, packed, self.center,
                                          self._levels)
        self.register_buffer("group_panels", held, False)
        self.register_buffer("_bias32", None if self.bias is None else self.bias.detach().float().contiguous(), False)
        self.qweight = self.scale = self.zero = self._levels = None  # the panels hold them now
        self._panels, self._dtype = kernel, dtype
        return True

    @property
    def records(self) -> bool:
        """Whether a call is one native call (on the panels): recordable in a decode call list."""
        return self._panels is not None

    def product_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        if self._panels is None:
            raise TypeError("Int8GroupLinear writes in place only on the panel kernels")
        self._panel_product(rows, out)

    def _panel_product(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if rows.dtype != self._dtype:
            raise TypeError(f"Int8GroupLinear on the panel kernels takes {str(self._dtype).removeprefix('torch.')} rows, got {rows.dtype}")
        from modserve.plugins.platforms.cpu_group_panels import group_product

        buffers = self._buffers
        return group_product(self._panels, rows, buffers["group_panels"], self._layout, self.out_features, self.in_features,
                             buffers["_bias32"], out=out)

    def extra_repr(self) -> str:
        held = f", panels: {self._layout.describe()}" if self._layout is not None else ", zeros" if self.zero is not None else ""
        return f"{super().extra_repr()}, group={self.group}" + (f", center={self.center}" if self.center else "") + held


GGUF_KEPT = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0")  # the GGUF types ``quantization: gguf`` keeps
GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K"}  # those held as int4 when a layer has no other kind
GGUF_FLOAT = ("F32", "F16", "BF16")  # stored unquantized: kept as a float layer


def gguf_linear(name: str, layer: nn.Module) -> nn.Module:
    """``quantization: gguf``: the module keeping ``layer``'s GGUF blocks as they are, or
    ``layer`` itself where the file stores it unquantized (F32 / F16 / BF16: the router of a
    mixture of experts, which llama.cpp keeps in F32) for the platform's float path.

    Every kept format is read as codes with a float32 scale and minimum per group of inputs
    (:func:`~modserve.core.models.gguf_quantized.group_codes`; the K-quants' two levels of
    scales multiplied out, exact), then:

    - Q4_0 / Q4_1 / Q4_K only: :class:`Int4WeightOnlyLinear` with groups of 32, the file's
      values (``w = d q + m`` is torch's ``(q - 8) d + (m + 8 d)``); the only change is the
      scales' and zeros' rounding to the model dtype (none in float32 but ``m + 8 d`` rounded
      once; bfloat16 keeps 8 bits of each).
    - a fused layer whose parts are of different kinds (int4: Q4_0 / Q4_1 / Q4_K in runs of
      a multiple of 64 outputs; Q8_0; the other formats), as llama.cpp's Q4_K_M mixes Q4_K
      q / k with a Q6_K v: one module per run of parts of one kind, side by side
      (:class:`~modserve.plugins.platforms.cpu_split_linear.ColumnSplitLinear`), each built
      by these rules.
    - anything else (Q8_0, Q6_K, Q5_0 / Q5_1 / Q5_K, a fused layer mixing those, or a Q4 layer
      whose out_features torch's int4 packing cannot take): :class:`Int8GroupLinear`, in
      groups of 16 where a Q6_K part is present, else 32. Without a Q8_0 part, the codes as stored (below 128) with
      each group's scale and minimum (``below_128``: exact), or only the scales and the formats'
      one center where every part is symmetric (Q6_K, Q5_0: 2 bits a weight fewer at groups of
      16), the K-quants' scales with their two levels (an int8 a group); with one, the codes centred to
      int8 (``q - 2^(bits - 1)``) with a zero per group where a part has a minimum
      (``m + 2^(bits - 1) d``, rounded once). A 4- to 6-bit weight takes a byte.

    A head tied to the embedding is built from the embedding's tensor (the loader's tied
    :class:`KeptLinear`), when ``quantize_lm_head`` asks for it.

    Anything else is refused, naming the layer and the types: an HF checkpoint or a layer
    not stored as a GGUF tensor (tensor parallelism loads none kept), other GGUF formats
    (Q2_K, Q3_K, the IQ types, ...) or a fused layer mixing float and quantized parts.
    The setting is never dropped silently: pick ``none``, ``int8`` or ``int4`` for such a file."""
    from modserve.core.models.gguf_quantized import GGUFTensor, TwoLevelScales, group_codes
    from modserve.core.models.kept_weights import KeptLinear

    if not isinstance(layer, KeptLinear) or not all(isinstance(p, GGUFTensor) for p in layer.parts):
        raise ConfigError(
            f"device.quantization: gguf keeps a GGUF file's blocks as they are, but layer {name!r} is not a GGUF tensor "
            "of its own (model.path is not a .gguf file, or the layer shares the embedding's weights); "
            "use none, int8, w8a8 or int4"
        )
    types = set(layer.types)
    if types <= set(GGUF_FLOAT):
        return layer
    if not types <= set(GGUF_KEPT):
        raise ConfigError(
            f"device.quantization: gguf keeps {', '.join(GGUF_KEPT)} weights; layer {name!r} is stored as "
            f"{'+'.join(layer.types)}: use none (dequantize at load), int8 or int4"
        )
    if len(pieces := _pieces_of_one_kind(layer)) > 1:
        from modserve.plugins.platforms.cpu_split_linear import ColumnSplitLinear

        return ColumnSplitLinear(layer, [gguf_linear(name, piece) for piece in pieces])
    parts = [group_codes(p) for p in layer.parts]
    if types <= GGUF_INT4 and layer.out_features % INT4_N_MULTIPLE == 0:
        q, d, m = (torch.cat(t) for t in zip(*((c.q.to(torch.int32), c.scale, c.minimum_or_center()) for c in parts)))
        levels = TwoLevelScales.cat([c.two_levels(32, minima=True) for c in parts])  # Q4_K's
        return Int4WeightOnlyLinear.from_codes(layer, q, d, m, 32, layer.dtype, levels)
    if types <= GGUF_INT4:
        log.info("gguf: %s has out_features %d, not a multiple of %d for torch's int4 packing: its %s blocks held as "
                 "int8 codes", name, layer.out_features, INT4_N_MULTIPLE, "+".join(sorted(types)))
    group = min(c.group for c in parts)
    if max(c.bits for c in parts) <= 7:  # the codes as stored, with their minima or their one center: exact
        scale, minimum = (torch.cat(t) for t in zip(*(c.per_group(group) for c in parts)))
        q = torch.cat([c.q for c in parts]).to(torch.int8)
        symmetric = all(c.minimum is None for c in parts) and len({c.center for c in parts}) == 1  # no zeros to hold
        levels = TwoLevelScales.cat([c.two_levels(group, minima=not symmetric) for c in parts])  # the K-quants'
        if symmetric:
            return Int8GroupLinear(layer, q, scale, group, torch.float32, below_128=True, center=parts[0].center, levels=levels)
        return Int8GroupLinear(layer, q, scale, group, torch.float32, minimum, below_128=True, levels=levels)
    q, d, z = zip(*(c.signed(group) for c in parts))
    zero = None if all(t is None for t in z) else torch.cat([t if t is not None else torch.zeros_like(s) for t, s in zip(z, d)])
    scale_dtype = torch.float16 if types == {"Q8_0"} else torch.float32  # Q8_0's own scales; the others' products need float32
    return Int8GroupLinear(layer, torch.cat(q), torch.cat(d), group, scale_dtype, zero)


def _pieces_of_one_kind(layer) -> list:
    """``layer``'s parts (a GGUF-kept fused layer's) in runs of one kind, each as a layer of its
    own (its rows of the bias): int4 (Q4_0 / Q4_1 / Q4_K, in a run of a multiple of 64 outputs,
    what the int4 panel kernels take), Q8_0 (int8 codes) and the rest (codes below 128)."""
    from modserve.core.models.kept_weights import KeptLinear

    widths = [p.shape[0] for p in layer.parts]
    kinds = ["int4" if t in GGUF_INT4 else "int8" if t == "Q8_0" else "codes" for t in layer.types]

    def runs() -> list[list[int]]:  # consecutive parts of one kind
        return [[i for i, _ in run] for _, run in itertools.groupby(enumerate(kinds), key=lambda ik: ik[1])]

    for run in runs():  # an int4 run the int4 panels cannot take: codes below 128 (exact)
        if kinds[run[0]] == "int4" and sum(widths[i] for i in run) % 64:
            kinds[run[0] : run[-1] + 1] = ["codes"] * len(run)
    if len(pieces := runs()) == 1:
        return [layer]
    out, start = [], 0
    for piece in pieces:
        n = sum(widths[i] for i in piece)
        kept = KeptLinear(nn.Linear(layer.in_features, n, bias=False, device="meta"), [layer.parts[i] for i in piece], layer.device,
                          layer.dtype)
        if layer.bias is not None:
            kept.bias = nn.Parameter(layer.bias.detach()[start : start + n], requires_grad=False)
        out.append(kept)
        start += n
    return out


def quantize_linear(scheme: str, name: str, layer: nn.Linear, int4_group: int = 128, amx: bool = False) -> nn.Module:
    """The quantized module for ``layer`` (qualified name ``name``) under ``scheme``; ``amx``:
    bfloat16 ``int8`` and ``w8a8`` layers run on AMX tiles."""
    if scheme == "int8":
        return Int8WeightOnlyLinear(layer, amx=amx and layer.weight.dtype == torch.bfloat16)
    if scheme == "w8a8":
        return W8A8Linear(layer, amx=amx and layer.weight.dtype == torch.bfloat16)
    if scheme == "int4":
        group = int4_group_size(name, layer.in_features, layer.out_features, int4_group)
        if group != int4_group:
            log.info("int4: %s has in_features %d, not a multiple of %d: group size %d", name, layer.in_features, int4_group, group)
        return Int4WeightOnlyLinear(layer, group)
    raise ValueError(f"device.quantization: unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
