"""A mixture-of-experts MLP (contract 2.8): the module a model builds for a sparse MLP, which
the platform may replace with its own computation of the same map (:meth:`Platform.experts`).

Kept apart from :mod:`modserve.core.contract.platform` because it imports torch, which the
light commands (``modserve validate``, ``modserve plugins``) do not load.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn


class ExpertMLP(nn.Module):
    """``forward(x [T, H]) -> [T, H]``: a router ``gate`` (a linear layer of ``num_experts``
    outputs, rounded to the model's dtype) gives each token a softmax over the experts in float32;
    its ``top_k`` experts are taken (renormalized over those k where ``norm_topk_prob``, then
    rounded to the model's dtype), each a SiLU-gated MLP of width ``intermediate``; the output is
    the experts' outputs (each rounded to the model's dtype) times their weights, summed in
    ascending expert order in the model's dtype (HF's Mixtral and Qwen3-MoE).

    The model's module (what :meth:`Platform.experts` receives) also holds the stacked expert
    weights: ``w13 [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``w2 [E, H, I]``.
    A platform's own module need not keep them."""

    # Like CausalLM.capturable: forward never waits on the host (no .tolist(), no shapes from
    # tensor values), so a decode step through it can be captured and replayed. A model with
    # experts is capturable only where all of its ExpertMLP modules are.
    capturable: ClassVar[bool] = False

    gate: nn.Module
    num_experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
