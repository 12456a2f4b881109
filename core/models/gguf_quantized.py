"""GGUF tensors kept in their own blocks (:mod:`~modserve.core.models.kept_weights` keeps
them until the platform builds each linear layer; without ``keep_blocks`` :func:`read_gguf`
dequantizes them at load), and the block formats the cpu platform maps onto its kernels:
:func:`group_codes` reads any of them as unsigned codes with one float32 scale and minimum per
group of inputs, ``w = scale * q + minimum``, the K-quants' also with their two levels of scales
as stored (:class:`TwoLevelScales`), which the cpu platform holds in fewer bytes.

Block formats (ggml; ``d``, ``dmin``, ``m`` float16), the weights of one output channel in order:

- 32 weights a block: ``Q8_0``: ``d``, 32 int8 ``q``: ``w = d q``. ``Q4_0``: ``d``, 16 bytes of
  nibbles: ``w = d (q - 8)``. ``Q4_1``: ``d``, ``m``, 16 bytes: ``w = d q + m``. In the nibble
  bytes, byte ``j`` holds weight ``j`` in its low half and weight ``j + 16`` in its high half.
  ``Q5_0`` / ``Q5_1``: as ``Q4_0`` / ``Q4_1`` (``w = d (q - 16)``, ``w = d q + m``) with 4
  bytes of fifth bits after the scales, bit ``j`` (little-endian) for weight ``j``.
- 256 weights a block (the K-quants), two-level scales resolved to one float32 scale (and
  minimum) per sub-block, exact: ``Q4_K``: ``d``, ``dmin``, 12 bytes of eight 6-bit scales
  ``sc`` and minima ``mn``, 128 bytes of nibbles: ``w = d sc q - dmin mn`` per 32 weights;
  each 64 weights take 32 bytes, low nibbles then high. ``Q5_K``: the same with 32 bytes of
  fifth bits before the nibbles (bit ``i`` of byte ``l`` for weight ``32 i + l``). ``Q6_K``: 128
  bytes of low nibbles, 64 of high 2-bit pairs, sixteen int8 scales, ``d``: ``w = d sc (q - 32)``
  per 16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from modserve.core.models.kept_weights import KeptTensor

BLOCK = 32  # weights per Q8_0 / Q4_x / Q5_x block; the K-quants' blocks hold QK_K = 256


@dataclass
class GGUFTensor(KeptTensor):
    """One GGUF tensor as stored: ``data`` is the file's array, one row per output channel
    (``uint8`` block bytes for quantized types, the values for F32/F16), rows already in HF order."""

    data: np.ndarray
    type: GGMLQuantizationType
    shape: tuple[int, int]  # (rows, columns) of the dequantized weight

    @property
    def kind(self) -> str:
        return self.type.name

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[rows, columns]``, an owned array (not a view of the file's mmap). The
        :data:`GROUP_FORMATS` go through their codes, ``scale * q + minimum`` in torch: the same
        values as gguf-py's dequantization (each product and sum exact or rounded alike), in
        about 0.4x its time (SmolLM2's Q4_1 layers: 1.1 s against 2.8 s)."""
        if self.type not in GROUP_FORMATS:
            return torch.from_numpy(np.require(dequantize(self.data, self.type), np.float32, ["C", "W"])).view(self.shape)
        codes = group_codes(self)
        n, k = self.shape
        w = codes.q.view(n, k // codes.group, codes.group).to(torch.float32)
        return w.mul_(codes.scale[..., None]).add_(codes.minimum_or_center()[..., None]).view(n, k)


@dataclass
class TwoLevelScales:
    """Scales (and minima) per group of inputs in two levels, as the K-quants store them: ``scale
    = scale_outer[n, k // (super_groups group)] * scale_inner[n, k // group]``, a float32 (float16
    in the file) per super block and a small integer per group; minima likewise. Each product is
    exact in float32 (11 by 8 bits): the levels hold the very values :class:`GroupCodes` gives,
    in fewer bytes."""

    scale_outer: torch.Tensor  # [N, K / super block] float32
    scale_inner: torch.Tensor  # [N, K / group] int8
    minimum_outer: torch.Tensor | None = None
    minimum_inner: torch.Tensor | None = None

    @staticmethod
    def cat(parts: list[TwoLevelScales | None]) -> TwoLevelScales | None:
        """The levels of parts stacked along the outputs, or None unless every part has them alike."""
        if any(p is None or (p.minimum_outer is None) != (parts[0].minimum_outer is None) for p in parts):
            return None
        if len({p.scale_outer.shape[1] for p in parts}) != 1:
            return None
        fields = ("scale_outer", "scale_inner", "minimum_outer", "minimum_inner")
        return TwoLevelScales(*(None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts]) for f in fields))


@dataclass
class GroupCodes:
    """A tensor's weights as ``w[n, k] = scale[n, k // group] * q[n, k] + minimum[n, k // group]``,
    ``q`` unsigned below ``2 ** bits``; ``minimum`` None for symmetric codes, ``w = scale (q - center)``."""

    q: torch.Tensor  # [N, K] uint8
    scale: torch.Tensor  # [N, K / group] float32
    minimum: torch.Tensor | None  # [N, K / group] float32
    group: int
    bits: int
    levels: TwoLevelScales | None = None  # the K-quants' scales and minima as stored

    @property
    def center(self) -> int:
        return 1 << (self.bits - 1)

    def minimum_or_center(self) -> torch.Tensor:
        """``minimum``, or the symmetric codes' ``-center * scale`` (exact: a power of two)."""
        return self.minimum if self.minimum is not None else self.scale * -self.center

    def per_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, minimum_or_center())`` per group of ``group`` inputs (a divisor of this
        tensor's group: each repeated)."""
        repeat = self.group // group
        return self.scale.repeat_interleave(repeat, dim=1), self.minimum_or_center().repeat_interleave(repeat, dim=1)

    def two_levels(self, group: int, minima: bool) -> TwoLevelScales | None:
        """:attr:`levels` per group of ``group`` inputs (a divisor of this tensor's group), with
        the minima where ``minima`` (a symmetric tensor's ``-center * scale``: outer ``-center
        d``, exact), or None where the tensor has no two levels."""
        if (lv := self.levels) is None:
            return None
        repeat = self.group // group
        inner = lv.scale_inner.repeat_interleave(repeat, dim=1)
        if not minima:
            return TwoLevelScales(lv.scale_outer, inner)
        if self.minimum is None:
            return TwoLevelScales(lv.scale_outer, inner, lv.scale_outer * -self.center, inner)
        return TwoLevelScales(lv.scale_outer, inner, lv.minimum_outer, lv.minimum_inner.repeat_interleave(repeat, dim=1))

    def signed(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(codes [N, K] int8 = q - center, scale, zero)`` per group of ``group`` (a divisor of
        this tensor's): ``w = scale * codes + zero``, ``zero = minimum + center * scale`` (rounded
        once in float32), None for symmetric codes."""
        codes = (self.q.to(torch.int16) - self.center).to(torch.int8)
        scale, minimum = self.per_group(group)
        return codes, scale, None if self.minimum is None else minimum + scale * self.center


def group_codes(tensor: GGUFTensor) -> GroupCodes:
    """The codes, scales and minima of a tensor stored as one of :data:`GROUP_FORMATS`."""
    n, k = tensor.shape
    return GROUP_FORMATS[tensor.type](np.ascontiguousarray(tensor.data).reshape(n, -1), n, k)


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 fields (two bytes on the last axis) as float32, that axis dropped."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _codes(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None, n: int, k: int, group: int, bits: int,
           levels: tuple[np.ndarray, ...] | None = None) -> GroupCodes:
    """``levels``: the K-quants' ``(d, sc)`` or ``(d, sc, -dmin, mn)``, ``d`` per block of 256."""
    def t(a: np.ndarray | None, dtype, cols: int) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype).reshape(n, cols))

    two = None
    if levels is not None:
        two = TwoLevelScales(*(t(a, np.float32 if i % 2 == 0 else np.int8, k // QK_K if i % 2 == 0 else k // group)
                               for i, a in enumerate(levels)))
    return GroupCodes(t(q, np.uint8, k), t(scale, np.float32, k // group), t(minimum, np.float32, k // group), group, bits, two)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., b]`` bytes as ``[..., 2 b]`` values: every low nibble, then every high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(data: np.ndarray, n: int, k: int) -> GroupCodes:
    b = data.reshape(n, k // BLOCK, 2 + BLOCK)
    return _codes(b[..., 2:].view(np.int8).astype(np.int16) + 128, _f16(b[..., :2]), None, n, k, BLOCK, 8)


def _legacy(head: int, fifth_bits: bool):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1: ``d`` (and ``m`` where ``head`` is 4), the fifth bits, nibbles."""
    def decode(data: np.ndarray, n: int, k: int) -> GroupCodes:
        b = data.reshape(n, k // BLOCK, head + 4 * fifth_bits + BLOCK // 2)
        q = _nibbles(b[..., head + 4 * fifth_bits:])
        if fifth_bits:
            high = np.unpackbits(b[..., head:head + 4], axis=-1, bitorder="little")  # bit j: weight j
            q = q | (high << 4)
        minimum = _f16(b[..., 2:4]) if head == 4 else None
        return _codes(q, _f16(b[..., :2]), minimum, n, k, BLOCK, 4 + fifth_bits)

    return decode


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes as eight 6-bit scales and eight 6-bit minima: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top bits of scales 4-7, bytes 4-7 likewise the minima,
    bytes 8-11 the low nibbles of scales 4-7 (low half) and minima 4-7 (high half)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quant(fifth_bits: bool):
    """Q4_K / Q5_K: ``d``, ``dmin``, the scales, (the fifth bits,) 128 bytes of nibbles."""
    def decode(data: np.ndarray, n: int, k: int) -> GroupCodes:
        b = data.reshape(n, k // QK_K, 16 + 32 * fifth_bits + QK_K // 2)
        sc, mn = _k_scales(b[..., 4:16])
        q = _nibbles(b[..., 16 + 32 * fifth_bits:].reshape(n, k // QK_K, 4, 32))  # [.., 4, 64]: sub-blocks 2j, 2j + 1
        q = q.reshape(n, k // QK_K, QK_K)
        if fifth_bits:
            high = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # [.., 32 l, 8 i]: weight 32 i + l
            q = q | (high.swapaxes(-1, -2).reshape(n, k // QK_K, QK_K) << 4)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        return _codes(q, d[..., None] * sc, -(dmin[..., None] * mn), n, k, BLOCK, 4 + fifth_bits, (d, sc, -dmin, mn))

    return decode


def _q6_k(data: np.ndarray, n: int, k: int) -> GroupCodes:
    b = data.reshape(n, k // QK_K, 128 + 64 + 16 + 2)
    low = _nibbles(b[..., :128].reshape(n, k // QK_K, 2, 64))  # [.., half, 128]: weights 128 h + 0..127
    qh = b[..., 128:192].reshape(n, k // QK_K, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [.., half, 4, 32]: weights 128 h + 32 i + l
    q = low | (high.reshape(n, k // QK_K, 2, 128) << 4)
    d, sc = _f16(b[..., 208:210]), b[..., 192:208].view(np.int8)
    return _codes(q, d[..., None] * sc.astype(np.float32), None, n, k, 16, 6, (d, sc))


QK_K = 256
T = GGMLQuantizationType
GROUP_FORMATS = {T.Q8_0: _q8_0, T.Q4_0: _legacy(2, False), T.Q4_1: _legacy(4, False), T.Q5_0: _legacy(2, True),
                 T.Q5_1: _legacy(4, True), T.Q4_K: _k_quant(False), T.Q5_K: _k_quant(True), T.Q6_K: _q6_k}
