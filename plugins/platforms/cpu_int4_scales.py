"""A GGUF layer's int4 scales in the bytes its file gave them, for the int4 panel kernels
(``native/int4_scales.h``'s ``Int4Scales``): ``w = q s + m`` per group of 32 inputs.

torch's int4 packing keeps ``(s, z = m + 8 s)`` in the activations' dtype: in float32, 2 bits a
weight on top of the nibbles' 4, where the file held Q4_0 / Q4_1 in 4.5 or 5 and Q4_K in 4.5
(float32 is the default dtype on CPUs without native bfloat16: AVX2-only ones); in bfloat16, 1
bit, with ``s`` and ``z`` rounded to 8 bits each. A one-row decode step reads every byte once.
So a GGUF layer on the panels keeps instead:

- Q4_0 / Q4_1: float16 ``(s, m)`` pairs (GGUF's own ``d``, ``m``; Q4_0's ``m = -8 d``): 1 bit;
- Q4_K: its two levels, int8 ``(sc, mn)`` pairs per group times float32 ``(d, -dmin)`` pairs
  per 256 inputs: 0.75 bits.

Both are exact: the weights are ``q s + m`` as the file defines them (torch's pairs round
``m + 8 s`` once more in float32, and both values to bfloat16 in bfloat16)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from modserve.core.models.gguf_quantized import TwoLevelScales

HALF, TWO_LEVEL = 1, 2  # Int4Scales' kinds (0: torch's scales_and_zeros)


@dataclass(frozen=True)
class FileScales:
    """``pairs [N/64, K/g, 2, 64]``: for each block of 64 outputs and group, a row of scales, then
    of minima (float16 ``s``, ``m``, or int8 ``sc``, ``mn``), and for the two levels ``outer
    [N/64, K/256, 2, 64]`` float32 (``d``, ``-dmin``) and the groups a super block holds."""

    kind: int
    pairs: torch.Tensor
    outer: torch.Tensor | None = None
    super_groups: int = 1

    def describe(self) -> str:
        return "float16 (s, m)" if self.kind == HALF else f"two-level scales per {self.super_groups} groups"


def file_scales(scale: torch.Tensor, minimum: torch.Tensor, levels: TwoLevelScales | None) -> FileScales | None:
    """The compact form of ``scale``, ``minimum`` ``[N, K/g]`` float32 (``levels``: the same as
    two levels), or None where neither form holds them exactly (then torch's pairs stay)."""
    if scale.shape[0] % 64:  # the int4 panels take blocks of 64 outputs
        return None
    if levels is not None and levels.minimum_outer is not None:
        groups, blocks = scale.shape[1], levels.scale_outer.shape[1]
        per_block = groups // blocks
        if per_block * blocks == groups and per_block & (per_block - 1) == 0 and _levels_hold(levels, scale, minimum, per_block):
            return FileScales(TWO_LEVEL, _rows(levels.scale_inner, levels.minimum_inner),
                              _rows(levels.scale_outer.float(), levels.minimum_outer.float()), per_block)
    if all(torch.equal(t.half().float(), t) for t in (scale, minimum)):
        return FileScales(HALF, _rows(scale.half(), minimum.half()))
    return None


def _rows(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` twice as ``[N/64, G, 2, 64]``: for each block of 64 outputs, each group's row
    of ``first`` values, then of ``second``: a block's scales in the order its kernels read them."""
    n, g = first.shape
    return torch.stack([first, second]).view(2, n // 64, 64, g).permute(1, 3, 0, 2).contiguous()


def _levels_hold(levels: TwoLevelScales, scale: torch.Tensor, minimum: torch.Tensor, per_block: int) -> bool:
    """Whether the levels' products are exactly ``scale`` and ``minimum`` (float32, outer times inner)."""
    def product(outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
        return outer.float().repeat_interleave(per_block, dim=1) * inner.float()

    return torch.equal(product(levels.scale_outer, levels.scale_inner), scale) and torch.equal(
        product(levels.minimum_outer, levels.minimum_inner), minimum)
