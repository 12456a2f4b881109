"""GGUF tensors kept in their own blocks (:mod:`~modserve.core.models.kept_weights` keeps
them until the platform builds each linear layer; without ``keep_blocks`` :func:`read_gguf`
dequantizes them at load), and the block formats the cpu platform maps onto its kernels.

Block formats (ggml, 32 weights per block, ``d`` and ``m`` float16):
``Q8_0``: ``d``, 32 int8 ``q``: ``w = d * q``. ``Q4_0``: ``d``, 16 bytes of nibbles:
``w = d * (q - 8)``. ``Q4_1``: ``d``, ``m``, 16 bytes: ``w = d * q + m``. In the nibble
bytes, byte ``j`` holds weight ``j`` in its low half and weight ``j + 16`` in its high half.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from modserve.core.models.kept_weights import KeptTensor

Q8_0, Q4_0, Q4_1 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1
BLOCK = 32  # weights per Q8_0 / Q4_0 / Q4_1 block


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
        """Float32 ``[rows, columns]``, an owned array (not a view of the file's mmap)."""
        return torch.from_numpy(np.require(dequantize(self.data, self.type), np.float32, ["C", "W"])).view(self.shape)


def q8_0_blocks(data: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] int8, d [N, K/32] float32)`` of a Q8_0 tensor: ``w[n, k] = d[n, k // 32] * q[n, k]``."""
    n, k = shape
    blocks = np.ascontiguousarray(data).reshape(n, k // BLOCK, 2 + BLOCK)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return torch.from_numpy(q), torch.from_numpy(d)


def q4_blocks(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [N, K] int32 in [0, 15], d [N, K/32] float32, m [N, K/32] float32)`` of a Q4_0 or
    Q4_1 tensor: ``w = d * q + m``, with ``m = -8 d`` for Q4_0 (its ``w = d * (q - 8)``)."""
    n, k = shape
    head = 4 if kind == Q4_1 else 2
    blocks = np.ascontiguousarray(data).reshape(n, k // BLOCK, head + BLOCK // 2)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == Q4_1 else -8.0 * d
    nibbles = torch.from_numpy(blocks[..., head:].copy())  # [N, K/32, 16]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # weights 0-15 then 16-31 of each block
    return q.to(torch.int32).reshape(n, k), torch.from_numpy(d), torch.from_numpy(m)
