"""Pre-quantized HF checkpoints: GPTQ, AWQ and compressed-tensors weights read as integer codes.

Each format packs a linear layer's integer weights into int32 words its own way; this module
reads a checkpoint's ``quantization_config`` (:func:`read_format`, refusing by name what it
cannot serve) and turns each quantized layer's tensors into one :class:`QuantizedWeight`:
codes ``q [N, K]`` (unsigned, ``0 .. 2^bits - 1``), and per group of inputs a scale and a
zero in code units, ``w = (q - zero) * scale``. The loader keeps them
(:mod:`~modserve.core.models.kept_weights`) and the cpu platform packs them into its int4 /
int8 modules (``device: {quantization: gptq | awq | compressed-tensors}``); any other setting
dequantizes each layer to the model dtype.

The layouts, as the formats' own packers write them (AutoGPTQ / GPTQModel, AutoAWQ,
compressed-tensors' ``pack_to_int32``):

- **GPTQ** ``qweight [K·b/32, N]``: input ``k`` of column ``n`` in word ``k // (32/b)``, bits
  ``b·(k % (32/b))``. ``qzeros [G, N·b/32]`` packed the same way along outputs, stored minus
  one (``checkpoint_format: gptq``; ``gptq_v2`` stores them as they are). ``scales [G, N]``.
  ``g_idx [K]``: each input's group, not in order when quantized with ``desc_act``
  (act-order): the inputs are then sorted by group once, and each call gathers the
  activations in that order (:attr:`QuantizedWeight.perm`).
- **AWQ** (``version: gemm``) ``qweight [K, N/8]``: outputs packed eight to a word in the
  order 0, 2, 4, 6, 1, 3, 5, 7 (output ``8j + i`` at bits ``4·[0, 4, 1, 5, 2, 6, 3, 7][i]``);
  ``qzeros [G, N/8]`` the same; ``scales [G, N]``; groups of consecutive inputs.
- **compressed-tensors** ``pack-quantized``: ``weight_packed [N, K·b/32]``, signed values
  offset by ``2^(b-1)`` and packed along inputs (``k`` at bits ``b·(k % (32/b))``);
  ``weight_scale [N, G]``; ``weight_zero_point`` (asymmetric) packed the same way along
  outputs; ``weight_shape``; ``weight_g_idx`` with activation ordering. ``int-quantized``:
  ``weight`` int8 ``[N, K]`` and ``weight_scale``, with or without dynamic per-token int8
  activations (W8A8).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from modserve.core.models.kept_weights import KeptTensor

SUPPORTED = (
    "gptq (4 or 8 bits, symmetric or not at 4, act-order included), awq (4 bits, version gemm), "
    "compressed-tensors (pack-quantized int4, int-quantized int8 weight-only or with dynamic per-token int8 activations)"
)
_AWQ_SHIFT_OF_OUTPUT = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8j + i sits at bits 4 * this[i] of word j


@dataclass(frozen=True)
class QuantFormat:
    """What a checkpoint's ``quantization_config`` says, reduced to what unpacking needs."""

    method: str  # gptq | awq | compressed-tensors
    bits: int
    group_size: int  # inputs per group; -1: one group per output channel
    symmetric: bool
    zeros_minus_one: bool = False  # GPTQ v1 stores each zero minus one
    activations: str | None = None  # "int8-per-token": W8A8 (compressed-tensors int-quantized)

    @property
    def kind(self) -> str:
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method}-int{self.bits}-{group}" + ("-w8a8" if self.activations else "")


def read_format(cfg: dict, where: str) -> QuantFormat:
    """The checkpoint's format from its ``quantization_config``; a ``ValueError`` naming
    ``where`` and the unsupported setting otherwise."""
    q = cfg["quantization_config"]
    method = q.get("quant_method")

    def refuse(what: str) -> ValueError:
        return ValueError(f"{where}: quantization_config: {method} with {what} is not supported; supported: {SUPPORTED}")

    if method == "gptq":
        bits, sym = int(q.get("bits", 4)), bool(q.get("sym", True))
        fmt = q.get("checkpoint_format", "gptq")
        if bits not in (4, 8):
            raise refuse(f"bits {bits}")
        if bits == 8 and not sym:
            raise refuse("asymmetric 8-bit weights (sym: false)")
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse(f"checkpoint_format {fmt!r}")
        if q.get("dynamic"):
            raise refuse("per-module `dynamic` overrides")
        return QuantFormat("gptq", bits, int(q.get("group_size", 128)), sym, zeros_minus_one=fmt == "gptq")
    if method == "awq":
        bits, version = int(q.get("bits", q.get("w_bit", 4))), str(q.get("version", "gemm")).lower()
        if bits != 4:
            raise refuse(f"bits {bits}")
        if version != "gemm":
            raise refuse(f"version {version!r}")
        if not q.get("zero_point", True):
            raise refuse("zero_point: false")
        return QuantFormat("awq", 4, int(q.get("group_size", q.get("q_group_size", 128))), False)
    if method == "compressed-tensors":
        return _compressed_tensors_format(q, refuse)
    raise ValueError(f"{where}: quantization_config: pre-quantized checkpoints ({method}) are not supported; supported: {SUPPORTED}")


def _compressed_tensors_format(q: dict, refuse) -> QuantFormat:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config groups (one is served)")
    if q.get("sparsity_config"):
        raise refuse("a sparsity_config")
    if q.get("kv_cache_scheme"):
        raise refuse("a kv_cache_scheme (use kv_cache.kv_dtype: int8)")
    scheme = next(iter(groups.values()))
    fmt = scheme.get("format") or q.get("format")
    w, act = scheme.get("weights") or {}, scheme.get("input_activations")
    if w.get("type") != "int":
        raise refuse(f"{w.get('type')} weights")
    strategy, bits, sym = w.get("strategy"), int(w.get("num_bits", 0)), bool(w.get("symmetric", True))
    if strategy not in ("group", "channel"):
        raise refuse(f"weight strategy {strategy!r}")
    group = int(w["group_size"]) if strategy == "group" else -1
    if fmt == "pack-quantized" and bits == 4 and act is None:
        return QuantFormat("compressed-tensors", 4, group, sym)
    if fmt not in ("int-quantized", "naive-quantized") or bits != 8:
        raise refuse(f"format {fmt!r} and {bits}-bit weights")
    if not sym:
        raise refuse("asymmetric int8 weights")
    if act is None:
        return QuantFormat("compressed-tensors", 8, group, True)
    if not (act.get("type") == "int" and int(act.get("num_bits", 0)) == 8 and act.get("dynamic") is True
            and act.get("strategy") == "token" and act.get("symmetric", True) and strategy == "channel"):
        raise refuse(f"input activations {act} (served: int8, dynamic, per token, symmetric, with per-channel weights)")
    return QuantFormat("compressed-tensors", 8, -1, True, activations="int8-per-token")


@dataclass
class Codes:
    """A layer's unpacked weights: ``w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]`` with
    ``g = k // group_size`` once the inputs are put in ``perm`` order (None: as they are)."""

    q: torch.Tensor  # [N, K] int32 codes, 0 .. 2^bits - 1, inputs in perm order
    scale: torch.Tensor  # [N, G] float32
    zero: torch.Tensor  # [N, G] float32, in code units
    group_size: int
    perm: torch.Tensor | None  # [K] int64


class QuantizedWeight(KeptTensor):
    """One quantized layer as the checkpoint stores it (its packed tensors by part name),
    unpacked only when the platform builds the layer (:meth:`codes`), so that loading holds
    the packed model and one unpacked layer at a time."""

    def __init__(self, fmt: QuantFormat, layer: str, parts: dict[str, torch.Tensor]) -> None:
        self.format, self.layer, self.parts = fmt, layer, parts
        missing = [p for p in _required(fmt) if p not in parts]
        if missing:
            raise ValueError(f"weights missing from checkpoint: {layer}.{missing[0]} ({fmt.kind} layer with {', '.join(sorted(parts))})")
        self.shape = _shape(fmt, parts)

    @property
    def kind(self) -> str:
        return self.format.kind

    def codes(self) -> Codes:
        return _unpack(self.format, self.parts, self.layer, self.shape)

    def dequantize(self) -> torch.Tensor:
        c = self.codes()
        n, k = c.q.shape
        w = (c.q.float().view(n, -1, c.group_size) - c.zero[..., None]).mul_(c.scale[..., None]).view(n, k)
        if c.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, c.perm] = w
        return out


_GPTQ_AWQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_CT_PACKED_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def quantized_tensors(tensors: Iterator[tuple[str, torch.Tensor]], fmt: QuantFormat) -> Iterator[tuple[str, torch.Tensor | KeptTensor]]:
    """The checkpoint's tensors with each quantized layer's packed parts gathered into one
    ``<layer>.weight`` :class:`QuantizedWeight` (after every other tensor: a layer's parts
    may come in any order, from any shard); other tensors pass through."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        layer, _, part = name.rpartition(".")
        if _is_quantized_part(fmt, part, t):
            layers.setdefault(layer, {})[part] = t
        else:
            yield name, t
    for layer, parts in layers.items():
        yield f"{layer}.weight", QuantizedWeight(fmt, layer, parts)


def _is_quantized_part(fmt: QuantFormat, part: str, t: torch.Tensor) -> bool:
    if fmt.method in ("gptq", "awq"):
        return part in _GPTQ_AWQ_PARTS
    if fmt.bits == 4:
        return part in _CT_PACKED_PARTS
    return (part == "weight" and t.dtype == torch.int8) or part == "weight_scale"  # int-quantized


def _required(fmt: QuantFormat) -> tuple[str, ...]:
    if fmt.method == "gptq":
        return ("qweight", "scales")
    if fmt.method == "awq":
        return ("qweight", "qzeros", "scales")
    if fmt.bits == 4:
        return ("weight_packed", "weight_scale", "weight_shape") + (() if fmt.symmetric else ("weight_zero_point",))
    return ("weight", "weight_scale")


def _shape(fmt: QuantFormat, parts: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(out_features, in_features)`` from the packed tensors."""
    if fmt.method == "gptq":
        rows, n = parts["qweight"].shape
        return n, rows * 32 // fmt.bits
    if fmt.method == "awq":
        k, cols = parts["qweight"].shape
        return cols * 8, k
    if fmt.bits == 4:
        n, k = (int(x) for x in parts["weight_shape"].tolist())
        return n, k
    n, k = parts["weight"].shape
    return n, k


def _unpack(fmt: QuantFormat, parts: dict[str, torch.Tensor], layer: str, shape: tuple[int, int]) -> Codes:
    n, k = shape
    half = float(1 << (fmt.bits - 1))  # the zero of symmetric codes
    if fmt.method == "gptq":
        q = _unpack_rows(parts["qweight"], fmt.bits).t()  # [N, K]
        scale = parts["scales"].float().t()  # [N, G]
        if fmt.symmetric:  # the zero is fixed at 2^(b-1) whatever qzeros holds, as every GPTQ reader takes it
            zero = torch.full_like(scale, half)
        elif "qzeros" not in parts:
            raise ValueError(f"weights missing from checkpoint: {layer}.qzeros (asymmetric GPTQ)")
        else:
            zero = _unpack_cols(parts["qzeros"], fmt.bits)[:, :n].t().float() + (1.0 if fmt.zeros_minus_one else 0.0)
        return _grouped(fmt, q, scale, zero, parts.get("g_idx"), layer)
    if fmt.method == "awq":
        q = _unpack_awq(parts["qweight"]).t()
        zero = _unpack_awq(parts["qzeros"])[:, :n].t().float()
        return _grouped(fmt, q, parts["scales"].float().t(), zero, None, layer)
    if fmt.bits == 4:
        q = _unpack_cols(parts["weight_packed"], 4)[:, :k]
        scale = parts["weight_scale"].float().reshape(n, -1)
        zero = _unpack_rows(parts["weight_zero_point"], 4)[:n].float() if "weight_zero_point" in parts else torch.full_like(scale, half)
        return _grouped(fmt, q, scale, zero, parts.get("weight_g_idx"), layer)
    q = parts["weight"].to(torch.int32) + 128  # int8, symmetric: codes 0..255 around 128
    scale = parts["weight_scale"].float().reshape(n, -1)
    return _grouped(fmt, q, scale, torch.full_like(scale, half), None, layer)


def _grouped(fmt: QuantFormat, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx, layer: str) -> Codes:
    """Check the shapes and put the inputs in group order."""
    n, k = q.shape
    groups = scale.shape[1]
    if scale.shape[0] != n or k % groups or zero.shape != scale.shape:
        raise ValueError(
            f"{layer}: {fmt.kind} tensors disagree: weight [{n}, {k}], scales {list(scale.shape)}, zeros {list(zero.shape)}"
        )
    size = k // groups
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,) or bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
            raise ValueError(f"{layer}: {fmt.kind} g_idx does not map {k} inputs onto {groups} groups")
        if not torch.equal(g_idx, torch.arange(k) // size):
            perm = torch.sort(g_idx, stable=True).indices
            if not torch.equal(g_idx[perm], torch.arange(k) // size):
                raise ValueError(f"{layer}: {fmt.kind} g_idx puts unequal numbers of inputs in its groups")
            q = q[:, perm]
    return Codes(q.contiguous(), scale.contiguous(), zero.contiguous(), size, perm)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R / (32/b), C]`` words -> ``[R, C]`` codes: row ``r`` in word ``r // (32/b)``, bits ``b·(r % (32/b))``."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C / (32/b)]`` words -> ``[R, C]`` codes, packed along columns the same way."""
    return _unpack_rows(packed.t(), bits).t()


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's ``[R, C/8]`` words -> ``[R, C]`` codes (its interleaved order, module doc)."""
    shifts = torch.tensor(_AWQ_SHIFT_OF_OUTPUT, dtype=torch.int32) * 4
    codes = (packed.to(torch.int32)[:, :, None] >> shifts[None, None, :]) & 0xF
    return codes.reshape(packed.shape[0], -1)
