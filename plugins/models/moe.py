"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts,
whose gated MLPs run as grouped products.

Grouped: the token copies are sorted by expert and every expert's rows go through one
``grouped_mm`` call per projection (``torch.nn.functional.grouped_mm``: the gate/up product
of all experts in one call, then the down product), instead of a Python loop over experts
or tokens. ``grouped = False`` switches to the loop over experts (the baseline that
``benchmarks/moe.py`` measures against).

Expert weights are stacked: ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``,
filled from the checkpoint's per-expert tensors. The router computes in float32, as HF's.

This is the reference computation of :class:`~modserve.core.contract.experts.ExpertMLP`; the
platform may replace it (``Platform.experts``, e.g. the ``cpu`` platform's one-call kernel,
:mod:`~modserve.plugins.platforms.cpu_experts`). It is not capturable: it sizes its expert
batches on the host (``counts.tolist()``, ``grouped_mm``'s offsets).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.contract import ModelSpec
from modserve.core.contract.experts import ExpertMLP


class SparseMoE(ExpertMLP):
    grouped = True

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        moe = spec.moe
        self.num_experts, self.top_k, self.intermediate = moe.num_experts, moe.top_k, moe.intermediate_size
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, spec.hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size, moe.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate.forward(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        rows = order // self.top_k  # the token of each sorted copy
        counts = torch.bincount(flat, minlength=self.num_experts)
        picked = x.index_select(0, rows)
        out = self._grouped(picked, counts) if self.grouped else self._looped(picked, counts)
        out *= weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        return x.new_zeros(x.shape).index_add_(0, rows, out)

    def _grouped(self, picked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        gate_up = F.grouped_mm(picked, self.w13.transpose(1, 2), offs=ends)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=ends)

    def _looped(self, picked: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = picked.new_empty(picked.shape[0], self.w2.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                gate, up = F.linear(picked[start : start + n], self.w13[e]).split(self.intermediate, dim=-1)
                out[start : start + n] = F.linear(F.silu(gate) * up, self.w2[e])
                start += n
        return out


def experts_capturable(model: nn.Module) -> bool:
    """Whether every mixture of experts in ``model`` (as the platform left it) is capturable:
    a model with experts declares itself capturable only then (a dense model: always)."""
    return all(m.capturable for m in model.modules() if isinstance(m, ExpertMLP))


def expert_route(prefix: str, expert: str, proj: str, intermediate: int) -> tuple[str, tuple]:
    """Where a checkpoint expert projection goes: ``gate`` and ``up`` fill ``w13``'s two halves of
    expert ``expert``, ``down`` fills its ``w2``."""
    e = int(expert)
    if proj == "down":
        return f"{prefix}.w2", (e,)
    half = slice(0, intermediate) if proj == "gate" else slice(intermediate, 2 * intermediate)
    return f"{prefix}.w13", (e, half)
