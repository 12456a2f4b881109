"""int8 experts (``device.quantization: int8`` on a mixture of experts): each expert's gate, up
and down weights as int8 codes with a symmetric scale per output channel, the ``int8`` scheme's
quantization of a linear layer (:func:`~modserve.plugins.platforms.cpu_quant.quantize_per_channel_int8`).

Why: in a mixture of experts the experts are most of the model's bytes (Qwen3-30B-A3B: 57 of its
61 GB in bfloat16), and a decode step reads a token's picked experts from memory; int8 halves
both. Where the experts kernel builds (:mod:`cpu_experts`), it multiplies the codes itself.
:class:`Int8LoopedExperts` is the portable path elsewhere: the model's routing, then each picked
expert's codes widened to float32 for its rows, the scales applied to the float32 sums, one
rounding to the model's dtype; slow (a loop over experts, sized on the host), but int8 in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from modserve.core.contract.experts import ExpertMLP
from modserve.plugins.models.moe import SparseMoE
from modserve.plugins.platforms.cpu_linear import linear_product
from modserve.plugins.platforms.cpu_quant import quantize_per_channel_int8


def quantize_experts(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked ``[E, N, K]`` expert weights as ``(codes [E, N, K] int8, scale [E, N] float32)``,
    ``w[e] ≈ codes[e] * scale[e][:, None]``; one expert's float copy at a time."""
    codes = torch.empty(weights.shape, dtype=torch.int8)
    scale = torch.empty(weights.shape[:2], dtype=torch.float32)
    for e in range(weights.shape[0]):
        codes[e], scale[e] = quantize_per_channel_int8(weights[e])
    return codes, scale


class Int8LoopedExperts(SparseMoE):
    """``moe``'s map with int8 experts, computed in torch: :class:`SparseMoE`'s routing and sum,
    each picked expert's products over its codes widened to float32 (``(x @ q.T) * scale``, one
    rounding to the model's dtype per product)."""

    grouped = False

    def __init__(self, moe: ExpertMLP) -> None:
        ExpertMLP.__init__(self)
        self.gate = moe.gate
        self.num_experts, self.top_k, self.intermediate = moe.num_experts, moe.top_k, moe.intermediate
        self.norm_topk_prob = moe.norm_topk_prob
        self.dtype = moe.w13.dtype
        q13, s13 = quantize_experts(moe.w13)
        q2, s2 = quantize_experts(moe.w2)
        self.register_buffer("q13", q13, False)
        self.register_buffer("scale13", s13, False)
        self.register_buffer("q2", q2, False)
        self.register_buffer("scale2", s2, False)

    def _looped(self, picked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = picked.new_empty(picked.shape[0], self.q2.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = self._product(picked[start : start + n], self.q13[e], self.scale13[e]).split(self.intermediate, dim=-1)
                out[start : start + n] = self._product(F.silu(gate) * up, self.q2[e], self.scale2[e])
                start += n
        return out

    def _product(self, rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return linear_product(rows.float(), codes.float()).mul_(scale).to(self.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate}, int8"
