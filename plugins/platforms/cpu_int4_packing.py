"""int4 weights packed in one layout on every CPU.

``torch._convert_weight_to_int4pack_for_cpu`` packs by the CPU capability torch runs at: in
blocks of 64 outputs on AVX-512 (byte j of input k holds output j and output j + 32), of 32 on
AVX2 (outputs j and j + 16), in adjacent pairs without either. Our native int4 kernels
(``native/int4_panels.h``) read the AVX-512 layout, so on an AVX2-only CPU torch's packing
gave them other outputs' nibbles. Layers whose outputs come in 64s are therefore packed here, in
that layout, whatever the CPU; torch's own int4 product gets a copy in its layout, made on the
first call that needs it, where the two differ.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 64  # outputs a block: the layout of torch's AVX-512 packing, which the native kernels read


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` (int32 in [0, 15]) as ``[N, K/2]`` uint8: for N a multiple of 64, in blocks of
    64 outputs, ``[K][32]`` bytes each, byte j holding output j (low nibble) and j + 32 (high);
    any other N (no native kernel takes it) as torch packs it on this CPU."""
    n, k = q.shape
    if n % BLOCK:
        return torch._convert_weight_to_int4pack_for_cpu(q, 1)
    halves = q.to(torch.uint8).view(n // BLOCK, 2, BLOCK // 2, k)  # [block, half, j, k]
    return (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack_int4`'s blocks of 64 back to ``q [N, K]`` int32."""
    n, half_k = packed.shape
    pairs = packed.view(n // BLOCK, half_k * 2, BLOCK // 2)  # [block, k, j]
    halves = torch.stack([pairs & 0xF, pairs >> 4], dim=1)  # [block, half, k, j]
    return halves.transpose(2, 3).reshape(n, half_k * 2).to(torch.int32)


@functools.cache
def torch_packs_in_blocks() -> bool:
    """Whether torch's int4 packing on this CPU is :func:`pack_int4`'s (probed once)."""
    q = torch.randint(0, 16, (BLOCK, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    return torch.equal(torch._convert_weight_to_int4pack_for_cpu(q, 1), pack_int4(q))


def for_torch(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` (from :func:`pack_int4`) in the layout torch's int4 product reads on this CPU:
    itself where the two agree (AVX-512 CPUs, any N that is not a multiple of 64), else a copy."""
    if packed.shape[0] % BLOCK or torch_packs_in_blocks():
        return packed
    return torch._convert_weight_to_int4pack_for_cpu(unpack_int4(packed), 1)
