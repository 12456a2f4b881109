"""INT8 KV quantization shared by every attention backend: one scale per token and head.

Symmetric absmax: ``scale = max|x| / 127`` over ``head_dim``, ``q = round(x / scale)``.
Keeping it in one place guarantees the torch and Triton backends store identical bytes.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


def quantize_per_token_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H, D]`` -> (``int8 [T, H, D]``, ``float32 scale [T, H]``)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-8) / INT8_MAX
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token_head` for any leading shape."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
