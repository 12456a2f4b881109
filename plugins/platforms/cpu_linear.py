"""Linear layers whose weights are reordered once for oneDNN, for inference on the CPU.

Why: ``F.linear`` on the CPU goes to MKL's sgemm, which re-packs the weight matrix on
every call. At decode batch sizes (16-64 tokens a step) that repacking of all of a
model's weights costs about as much as the arithmetic: SmolLM2's MLP and head ran at
30-70 GFLOP/s where the machine peaks near 150. oneDNN with the weight reordered into
its blocked layout at load time runs the same products 1.3-2.5x faster at 16-64 tokens
and as fast at prefill sizes (figures: docs/cpu_attention.md). Results equal ``F.linear``
up to float32 summation order.

Only where oneDNN can: a CPU device and a dtype it reorders on this CPU (float32
everywhere; bfloat16 needs AVX-512 or AVX-NE-CONVERT). Anything else keeps ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


_LINEAR = torch.ops.mkldnn._linear_pointwise.default


def float32_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(rows, weight, bias)`` for float32 ``rows [M, K]`` and a plain ``weight [N, K]``
    (any strides, say a view of a scratch matrix), by oneDNN. Why not ``F.linear``: torch's
    float32 product is MKL's sgemm, whose kernels depend on the CPU's vendor; on a Zen 4 it ran
    SmolLM2's prefill shapes at 125-170 GFLOP/s where oneDNN, which picks its kernels by
    instruction set, ran them at 200-210 on the same plain weights (docs/cpu_linears.md)."""
    return _LINEAR(rows, weight, bias, "none", [], "")


def linear_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(rows, weight, bias)`` for rows ``[M, K]`` of the weight's dtype: float32 by
    :func:`float32_product` (oneDNN) where torch has oneDNN, else ``F.linear`` (other dtypes
    keep torch's own dispatch). For the layers that widen quantized
    weights per call where no panel kernel takes them (say under ``linear_kernel: onednn``). On
    a Zen 4, SmolLM2's MLP shapes at 1-1,024 rows, MKL's sgemm took 1.0-2.0x oneDNN's time on
    the same plain weights (0.90x once: the down projection at one row)."""
    if rows.dtype == torch.float32 and rows.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return float32_product(rows, weight, bias)
    return F.linear(rows, weight, bias)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held only in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None), False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] in _CHUNK_SIZES:  # the model's rows, one exact chunk: one call
            return _LINEAR(x, self.packed, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if m == 0:  # e.g. the LM head in a step that samples nothing (a prompt chunk)
            return x.new_empty(*x.shape[:-1], self.out_features)
        parts = [self._product(rows[start : start + size], size) for start, size in row_chunks(m)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out[:m].view(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor, size: int) -> torch.Tensor:
        if rows.shape[0] < size:  # the last few rows, padded up to the smallest chunk
            rows = torch.cat([rows, rows.new_zeros(size - rows.shape[0], rows.shape[1])])
        return _LINEAR(rows, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


MAX_CHUNK, MIN_CHUNK = 2048, 4  # a 2048-token prefill step runs whole (no concatenation of parts)
PAD_BELOW, ROW_STEP = 64, 64  # rows up to 64 pad to a power of two (to 8s above 32), more to a multiple of 64


def _padded(rows: int) -> int:
    """The chunk size that holds ``rows`` (at most MAX_CHUNK)."""
    if rows <= 32:
        return max(MIN_CHUNK, 1 << (rows - 1).bit_length())
    if rows <= PAD_BELOW:
        return -(-rows // 8) * 8
    return -(-rows // ROW_STEP) * ROW_STEP


_CHUNK_SIZES = frozenset(_padded(m) for m in range(1, MAX_CHUNK + 1))  # the 39 shapes oneDNN sees


def row_chunks(m: int) -> list[tuple[int, int]]:
    """``(start, size)`` pieces covering ``m`` rows: whole MAX_CHUNKs, then the rest as one
    call padded up to a power of two (up to 32 rows), a multiple of 8 (up to PAD_BELOW) or
    a multiple of ROW_STEP (the last chunk may extend past ``m``).

    oneDNN builds (and keeps) a primitive for every input shape it sees; with the batch size
    changing every step that grew a server by hundreds of MB, so sizes come from a fixed set
    of 39. One padded call beats several exact ones, since every call streams the whole
    weight matrix again: 13 rows as one call of 16 took 39 us where 8 + 4 + 4 took 86
    (SmolLM2's qkv, bfloat16), and a step of 15 decode rows plus a 200-320-token prompt ran
    8% faster per row as one call (a multiple of 64) than as power-of-two pieces. Between 32
    and 64 rows the bf16 GEMM's cost steps (SmolLM2's 30 layers: 40 rows 15.4 ms, 48 rows
    20.3, 64 rows 22.3), so there the padding stops at the next multiple of 8.
    """
    chunks, start = [], 0
    while m - start > MAX_CHUNK:
        chunks.append((start, MAX_CHUNK))
        start += MAX_CHUNK
    if m > start:
        chunks.append((start, _padded(m - start)))
    return chunks


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except RuntimeError:  # e.g. bfloat16 on a CPU without AVX-512
        return False
    return True


def pack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` under ``model`` for a :class:`PackedLinear`; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
