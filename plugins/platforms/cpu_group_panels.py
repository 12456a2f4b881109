"""Group panels: int8 codes with a scale, and optionally a zero, per group of inputs of each
output (GGUF Q8_0, Q6_K, Q5_x, K-quant mixes, GPTQ 8-bit), laid out as the group kernels read
them (``native/group_int8_panels.h``'s ``GroupPanels``), and the call of those kernels.

A panel of 16 outputs is one sequential stream: group after group, the group's codes in the
panels' pair order (6 bits each where they fit), then its 16 scales, then its 16 zeros. The
scales take no more bytes than the file gave them: float16 where every scale and zero is a
float16 (GGUF's Q8_0 and Q4/Q5_0/1 blocks), the K-quants' two levels as they are stored (an int8
per group, times float32 outer scales that head each super block), float32 otherwise. A
one-row decode step reads every byte once, so bytes are its time."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from modserve.core.contract import NativeFunction
from modserve.core.models.gguf_quantized import TwoLevelScales
from modserve.plugins.platforms.cpu_panel_linear import TILE_N, product_output, pack_tiles, tile_rows

# The group-scaled int8 entries: x, x_stride, M, group panels, N, K, group, bias, y, y_stride, threads, then the
# layout's flags (GroupLayout.flags: whether the groups store zeros, the codes' center, whether they are packed to
# 6 bits, the scales' bytes, groups per super block).
GROUP_INT8_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int]
PACKED_GROUP_MAX = 32  # the largest group whose codes may be packed (native/group_int8_panels.h's kMaxPackedGroup)


@dataclass(frozen=True)
class GroupLayout:
    """How a layer's group panels hold it: what the kernels need besides the bytes."""

    group: int
    zeros: bool  # each group stores its zeros
    center: float  # symmetric codes kept as stored: w = d (q - center); 0 for none
    packed: bool  # the codes in 6 bits
    scale_bytes: int  # 4: float32 scales and zeros; 2: float16; 1: int8 multiples of their super block's float32 ones
    super_groups: int = 0  # scale_bytes 1: groups per super block

    @property
    def flags(self) -> tuple[int, float, int, int, int]:
        return int(self.zeros), self.center, int(self.packed), self.scale_bytes, self.super_groups

    def describe(self) -> str:
        scales = {4: "float32", 2: "float16", 1: f"two-level scales per {self.super_groups} groups"}[self.scale_bytes]
        return f"{scales}" + (", zeros" if self.zeros else "") + (", 6-bit" if self.packed else "")


def group_panels(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int, packed: bool = False,
                 center: float = 0.0, levels: TwoLevelScales | None = None) -> tuple[torch.Tensor, GroupLayout]:
    """``codes [N, K]`` int8 with float32 ``scales`` (and ``zeros``) ``[N, K/group]`` as the group
    kernels read them, and their layout: ``[N/16][K/group]`` byte rows, each a group's codes in the
    panels' pair order, then its 16 outputs' scales, then their zeros; with ``levels`` (the same
    scales and zeros as two levels) ``[N/16][super blocks]`` rows, each the block's 16 outer
    scales (and zeros) in float32 before its groups, whose own take an int8 each.

    ``packed``: codes below 64 (GGUF's 4- to 6-bit formats) in 6 bits each (:func:`pack_6_bits`),
    groups of at most :data:`PACKED_GROUP_MAX`. Without ``levels``, the scales and zeros take
    float16 where every one of them is a float16 (exactly), else float32."""
    n, k = codes.shape
    if packed and (group > PACKED_GROUP_MAX or codes.min() < 0 or codes.max() >= 64):
        raise ValueError(f"group_panels: packs codes in [0, 64) in groups of at most {PACKED_GROUP_MAX}, got {group} "
                         f"and codes in [{int(codes.min())}, {int(codes.max())}]")
    groups = k // group
    in_pairs = pack_tiles(codes).view(n // TILE_N, groups, group * TILE_N)
    per_group = [pack_6_bits(in_pairs) if packed else in_pairs]
    if levels is not None:
        super_groups = _super_groups(levels, scales, zeros, groups)
        values, outer = (levels.scale_inner, levels.minimum_inner), (levels.scale_outer, levels.minimum_outer)
        scale_bytes = 1
    else:
        super_groups = 0
        values = (scales, zeros)
        scale_bytes = 2 if all(t is None or _is_half(t) for t in values) else 4
    for t in values[: 2 if zeros is not None else 1]:  # [N, K/g] as [N/16][K/g][16], bytes
        t = t.to({4: torch.float32, 2: torch.float16, 1: torch.int8}[scale_bytes])
        per_group.append(_by_panel(t, n).view(torch.int8))
    held = torch.cat(per_group, dim=2)
    if levels is not None:  # each super block's outer scales (and zeros) before its groups
        heads = [_by_panel(t, n).view(torch.int8) for t in outer[: 2 if zeros is not None else 1]]
        held = torch.cat([*heads, held.reshape(n // TILE_N, groups // super_groups, -1)], dim=2)
    layout = GroupLayout(group, zeros is not None, float(center), packed, scale_bytes, super_groups)
    return held.contiguous(), layout


def _by_panel(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[N, C]`` as ``[N/16][C][16]``: a panel's 16 outputs side by side, column after column."""
    return t.reshape(n // TILE_N, TILE_N, -1).transpose(1, 2).contiguous()


def _is_half(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.to(torch.float16).float(), t.float()))


def _super_groups(levels: TwoLevelScales, scales: torch.Tensor, zeros: torch.Tensor | None, groups: int) -> int:
    """Groups per super block of ``levels``, checked: a power of two, and the levels' products
    exactly ``scales`` and ``zeros`` (as the kernels compute them: float32, outer times inner)."""
    super_groups = groups // levels.scale_outer.shape[1]
    if super_groups * levels.scale_outer.shape[1] != groups or super_groups & (super_groups - 1):
        raise ValueError(f"group_panels: two-level scales need a power of two of groups per super block, got {groups} groups "
                         f"in {levels.scale_outer.shape[1]} blocks")
    for name, value, outer, inner in (("scales", scales, levels.scale_outer, levels.scale_inner),
                                      ("zeros", zeros, levels.minimum_outer, levels.minimum_inner)):
        if value is None:
            continue
        if outer is None or inner.min() < -128 or inner.max() > 127:
            raise ValueError(f"group_panels: the two-level {name} need an outer float32 and an inner int8 level")
        product = outer.float().repeat_interleave(super_groups, dim=1) * inner.float()
        if not torch.equal(product, value.float()):
            raise ValueError(f"group_panels: the two-level {name} differ from the {name} they stand for")
    return super_groups


def pack_6_bits(codes: torch.Tensor) -> torch.Tensor:
    """Codes in ``[0, 64)``, ``[..., G]`` bytes in the panels' pair order (32 a pair, G a multiple
    of 128), as 6 bits each, ``[..., 3 G / 4]``: each quad of pairs ``s0..s3`` as the low nibbles
    of ``s0`` and ``s1`` (``s1``'s in each byte's high half), those of ``s2`` and ``s3``, then the
    four pairs' high two bits (``s``'s at bits ``2 s``): what ``packed_step`` reads back."""
    quads = codes.view(torch.uint8).view(*codes.shape[:-1], -1, 4, 32)  # in bytes: a layer's codes are loaded whole
    low, high = quads & 15, quads >> 4
    lo01 = low[..., 0, :] | low[..., 1, :] << 4
    lo23 = low[..., 2, :] | low[..., 3, :] << 4
    hi = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6
    return torch.stack([lo01, lo23, hi], dim=-2).view(torch.int8).reshape(*codes.shape[:-1], codes.shape[-1] * 3 // 4)


def group_product(kernel: NativeFunction, rows: torch.Tensor, panels: torch.Tensor, layout: GroupLayout, n: int, k: int,
                  bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows [M, k]`` times ``n`` outputs' group-scaled int8 codes held as group panels
    (:func:`group_panels`, with their ``layout``), plus ``bias``, by one call of an entry taking
    :data:`GROUP_INT8_ARGS`; ``out`` as for
    :func:`~modserve.plugins.platforms.cpu_panel_linear.widened_product`."""
    rows = tile_rows(rows)
    out = product_output(rows, n, out, "group_product")
    kernel(
        rows.data_ptr(), rows.stride(0), rows.shape[0], panels.data_ptr(), n, k, layout.group, None if bias is None else bias.data_ptr(),
        out.data_ptr(), out.stride(0), torch.get_num_threads(), *layout.flags,
    )  # fmt: skip
    return out
