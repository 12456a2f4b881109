"""A pre-quantized HF checkpoint's layers on the cpu platform's int4 / int8 modules
(``device: {plugin: cpu, quantization: gptq | awq | compressed-tensors}``).

The loader hands each quantized layer over as a
:class:`~modserve.core.models.kept_weights.KeptLinear` whose parts are
:class:`~modserve.core.models.prequantized.QuantizedWeight` (q/k/v or gate/up: several);
their codes go into the modules of :mod:`cpu_quant` without a float copy:

- 4 bits: :class:`~cpu_quant.Int4WeightOnlyLinear` (``w = q * scale + minimum`` with
  ``minimum = -zero * scale``: the checkpoint's values, the scales and zeros held in the
  model dtype). Its kernel takes groups of 32, 64, 128 or 256 inputs: a larger group (or one
  per channel) is split into equal smaller ones with the same scale and zero, which is exact;
- 8 bits: int8 codes ``q - 128``, symmetric: one scale per channel goes to
  :class:`~cpu_quant.Int8WeightOnlyLinear`, or :class:`~cpu_quant.W8A8Linear` where the
  checkpoint asks for dynamic per-token int8 activations; group-wise scales go to
  :class:`~cpu_quant.Int8GroupLinear` (widened per call).

GPTQ act-order layers keep their inputs in group order and gather each call's activations
in it (``QuantizedLinear.input_order``). A layer the checkpoint stores as floats (the head,
an ignored layer) stays a float layer: the checkpoint chose it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from modserve.core.config import ConfigError
from modserve.core.contract import NativeFunction
from modserve.core.models.kept_weights import FloatWeight, KeptLinear
from modserve.core.models.prequantized import Codes, QuantizedWeight
from modserve.plugins.platforms.cpu_int8_panel_linear import Int8PanelLinear
from modserve.plugins.platforms.cpu_quant import (
    INT4_GROUP_SIZES,
    INT4_N_MULTIPLE,
    Int4WeightOnlyLinear,
    Int8GroupLinear,
    Int8WeightOnlyLinear,
    QuantizedLinear,
    W8A8Linear,
)

CHECKPOINT_SCHEMES = ("gptq", "awq", "compressed-tensors")


def checkpoint_linear(scheme: str, name: str, layer: nn.Module, amx: bool = False, amx_int8: bool = False,
                      int8_panels: Callable[[torch.dtype], NativeFunction | None] = lambda dtype: None) -> nn.Module:
    """The module for ``layer`` (qualified ``name``) of a ``scheme`` checkpoint, or ``layer``
    itself where the checkpoint stores it unquantized; ``amx``: bfloat16 int4 and int8 layers on
    AMX tiles, ``amx_int8``: W8A8 layers on AMX-INT8 tiles; ``int8_panels(dtype)``: the panel
    kernel's int8 entry for a model of that dtype (or None), which per-channel int8 weight-only
    layers in the checkpoint's input order run on (:class:`Int8PanelLinear`)."""
    if not isinstance(layer, KeptLinear) or all(isinstance(p, FloatWeight) for p in layer.parts):
        return layer
    if any(isinstance(p, FloatWeight) for p in layer.parts):
        raise ConfigError(
            f"device.quantization: layer {name!r} fuses quantized and float parts ({'+'.join(layer.types)}); "
            "it cannot run as one product: use none (dequantize at load)"
        )
    if not all(isinstance(p, QuantizedWeight) for p in layer.parts):
        raise ConfigError(
            f"device.quantization: {scheme} keeps a {scheme} checkpoint's weights, but layer {name!r} is stored as "
            f"{'+'.join(layer.types)}: use gguf for a GGUF file"
        )
    methods = {p.format.method for p in layer.parts}
    if methods != {scheme}:
        raise ConfigError(f"device.quantization: {scheme}, but model.path is a {'/'.join(sorted(methods))} checkpoint: use {min(methods)}")
    formats = {p.format for p in layer.parts}
    if len(formats) > 1:
        raise ConfigError(f"device.quantization: layer {name!r} fuses parts of different formats ({', '.join(sorted(f.kind for f in formats))})")
    fmt = formats.pop()
    codes = _fused(name, [p.codes() for p in layer.parts])
    w8a8, bf16 = fmt.activations is not None, layer.dtype == torch.bfloat16
    if fmt.bits == 4:
        module = _int4(name, layer, codes)
    else:
        module = _int8(name, layer, codes, w8a8, (amx_int8 if w8a8 else amx) and bf16, int8_panels(layer.dtype) if codes.perm is None else None)
    module.input_order = codes.perm
    return module


def _fused(name: str, parts: list[Codes]) -> Codes:
    """One layer's codes from its parts (rows stacked); their groups and input order must agree."""
    first = parts[0]
    for p in parts[1:]:
        same_order = (p.perm is None and first.perm is None) or (
            p.perm is not None and first.perm is not None and torch.equal(p.perm, first.perm))
        if p.group_size != first.group_size or not same_order:
            raise ConfigError(
                f"device.quantization: layer {name!r} fuses parts with different groups or input orders (act-order g_idx); "
                "it cannot run as one product"
            )
    if len(parts) == 1:
        return first
    rows = [torch.cat([getattr(p, name) for p in parts]) for name in ("q", "scale", "zero")]  # each part's rows in order
    return Codes(*rows, first.group_size, first.perm)


def _int4(name: str, layer: KeptLinear, c: Codes) -> QuantizedLinear:
    if layer.out_features % INT4_N_MULTIPLE:
        raise ConfigError(
            f"device.quantization: int4 needs out_features to be a multiple of {INT4_N_MULTIPLE}; layer {name!r} has "
            f"{layer.out_features}: use none (dequantize at load)"
        )
    fits = [g for g in INT4_GROUP_SIZES if c.group_size % g == 0]
    if not fits:
        raise ConfigError(
            f"device.quantization: layer {name!r} has groups of {c.group_size} inputs; the int4 kernel takes "
            f"{', '.join(map(str, INT4_GROUP_SIZES))} or multiples of them: use none (dequantize at load)"
        )
    group = fits[-1]
    split = c.group_size // group
    scale, zero = c.scale.repeat_interleave(split, dim=1), c.zero.repeat_interleave(split, dim=1)
    return Int4WeightOnlyLinear.from_codes(layer, c.q, scale, -zero * scale, group, layer.dtype)


def _int8(name: str, layer: KeptLinear, c: Codes, w8a8: bool, amx: bool, panels: NativeFunction | None) -> nn.Module:
    if not bool((c.zero == 128).all()):
        raise ConfigError(f"device.quantization: layer {name!r} has asymmetric int8 weights; the int8 kernels are symmetric")
    q = (c.q - 128).to(torch.int8)
    if c.scale.shape[1] == 1:
        if w8a8:
            return W8A8Linear(layer, codes=(q, c.scale[:, 0]), amx=amx)
        if panels is not None and not amx:
            return Int8PanelLinear(layer, panels, layer.dtype, codes=(q, c.scale[:, 0]))
        return Int8WeightOnlyLinear(layer, codes=(q, c.scale[:, 0]), dtype=layer.dtype, amx=amx)
    return Int8GroupLinear(layer, q, c.scale, c.group_size, scale_dtype=torch.float32)
