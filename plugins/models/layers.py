"""Building blocks the decoder model plugins share: RMSNorm, attention, the gated MLP.

On the hot path submodules are called through ``.forward``: ``nn.Module.__call__`` costs
about 2 us of hook bookkeeping a call, 270 calls in a decode step, and modserve registers
no module hooks. ``fused`` switches (set by :meth:`DecoderLM.use_cpu_fused_ops`) run the
elementwise work as the one-pass C++ kernels of :mod:`modserve.core.models.cpu_fused`.

With ``tp`` (a :class:`modserve.core.distributed.tp.TPGroup`) a block is one rank's shard
(Megatron-style): this rank's heads and MLP columns, an all-reduce after ``o_proj`` and
``down_proj``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from modserve.core.contract import AttentionBackend, AttentionMetadata, GatedLinear, LayerKVCache, ModelSpec
from modserve.core.models import cpu_fused
from modserve.core.models.rope import apply_rotary

class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale.

    Called on the residual stream with the previous sublayer's output as ``add``, it first
    adds it in place (``residual += add``), so the add and the norm can run as one kernel.
    ``unit_offset`` (Gemma): scale by ``1 + weight`` in float32, then cast back.
    """

    fused = False  # set by DecoderLM.use_cpu_fused_ops

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, residual: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused:
            return cpu_fused.add_rms_norm(residual, add, self.weight, self.eps, self.unit_offset)
        if add is not None:
            residual.add_(add)
        xf = residual.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(residual.dtype)
        return self.weight * xf.to(residual.dtype)

    def add_normed_(self, residual: torch.Tensor, x: torch.Tensor) -> None:
        """``residual += norm(x)`` (a post-norm layer's residual add), one kernel when fused."""
        if self.fused:
            cpu_fused.rms_norm_heads(x, self.weight, self.eps, 1, add_to=residual, offset=self.unit_offset)
        else:
            residual.add_(self.forward(x))


class Attention(nn.Module):
    """Self-attention over the paged KV cache, q/k/v as one fused projection.

    ``qk_norm``: RMSNorm of q and k before RoPE, per head (``"head"``, Qwen3) or over the
    whole projection (``"full"``, OLMo 2). ``spec.rotary_dim`` below ``head_dim``: only the
    first ``rotary_dim`` channels of each head rotate (Phi-4-mini); ``norm_offset``: the q/k
    norms scale by ``1 + weight`` (Gemma 3). ``backend`` may be replaced by its per-layer view
    (:meth:`AttentionBackend.for_layer`) when the model is assembled (:class:`DecoderLM`)."""

    def __init__(
        self, spec: ModelSpec, backend: AttentionBackend, tp=None, qk_norm: Literal["head", "full"] | None = None,
        norm_offset: bool = False,
    ) -> None:
        super().__init__()
        n = tp.world_size if tp is not None else 1
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads // n, spec.num_kv_heads // n, spec.head_dim
        self.rotary_dim = spec.rotary_dim or spec.head_dim
        self.tp = tp
        q_size, kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.split), bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm is not None:
            q_width, k_width = (spec.head_dim, spec.head_dim) if qk_norm == "head" else (q_size, kv_size)
            self.q_norm = RMSNorm(q_width, spec.rms_norm_eps, norm_offset)
            self.k_norm = RMSNorm(k_width, spec.rms_norm_eps, norm_offset)
        self.backend = backend
        self.fused = False  # set by DecoderLM.use_cpu_fused_ops

    def forward(self, x, cos, sin, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        fused_rope, r = self.fused, self.rotary_dim
        if self.qk_norm is None:
            if fused_rope:  # rotate q and k in place inside the fused qkv rows (their first r channels)
                cpu_fused.rope_(qkv, cos.squeeze(1), sin.squeeze(1), h + kvh, d, r)
            q, k, v = qkv.split_with_sizes(self.split, -1)  # not Tensor.split's Python wrapper: 1.5 against 3.4 us
        else:
            q, k, v = self._normed(qkv, t)  # fresh contiguous q and k
            if fused_rope:
                cos, sin = cos.squeeze(1), sin.squeeze(1)
                cpu_fused.rope_(q, cos, sin, h, d, r)
                cpu_fused.rope_(k, cos, sin, kvh, d, r)
        q, k = q.view(t, h, d), k.view(t, kvh, d)
        if not fused_rope:
            q, k = _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)
        out = self.backend.forward(q, k, v.view(t, kvh, d), cache, meta)
        out = self.o_proj.forward(out.reshape(t, -1))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _normed(self, qkv: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split_with_sizes(self.split, -1)
        if self.fused:  # read in place from the qkv rows (recordable: no torch copy)
            heads = (self.num_heads, self.num_kv_heads) if self.qk_norm == "head" else (1, 1)
            offset = self.q_norm.unit_offset
            q = cpu_fused.rms_norm_heads(q, self.q_norm.weight, self.q_norm.eps, heads[0], offset=offset)
            return q, cpu_fused.rms_norm_heads(k, self.k_norm.weight, self.k_norm.eps, heads[1], offset=offset), v
        if self.qk_norm == "head":
            q = self.q_norm.forward(q.reshape(t * self.num_heads, self.head_dim)).view(t, -1)
            k = self.k_norm.forward(k.reshape(t * self.num_kv_heads, self.head_dim)).view(t, -1)
        else:
            q, k = self.q_norm.forward(q.contiguous()), self.k_norm.forward(k.contiguous())
        return q, k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``activation`` ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma)."""

    def __init__(self, spec: ModelSpec, tp=None, activation: Literal["silu", "gelu_tanh"] = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.intermediate = spec.intermediate_size // (tp.world_size if tp is not None else 1)
        self.tp = tp
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, spec.hidden_size, bias=False)
        self.fused = False  # set by DecoderLM.use_cpu_fused_ops
        self.gated_product = False  # gate_up_proj returns silu(gate) * up itself (see fuse_gated_product)

    def fuse_gated_product(self) -> bool:
        """With fused ops on, let a platform's gate_up layer that can (a
        :class:`~modserve.core.contract.GatedLinear`) compute ``silu(gate) * up`` itself."""
        if self.fused and self.activation == "silu" and isinstance(self.gate_up_proj, GatedLinear):
            self.gated_product = self.gate_up_proj.enable_silu_mul()
        return self.gated_product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated_product:
            out = self.down_proj.forward(self.gate_up_proj.forward(x))
            return out if self.tp is None else self.tp.all_reduce(out)
        gate_up = self.gate_up_proj.forward(x)
        if self.fused:
            act_mul = cpu_fused.silu_mul if self.activation == "silu" else cpu_fused.gelu_tanh_mul
            out = self.down_proj.forward(act_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
            out = self.down_proj.forward(act * up)
        return out if self.tp is None else self.tp.all_reduce(out)


