"""Model plugin ``granite``: IBM Granite (3.x dense, ``GraniteForCausalLM``).

Llama's layers with four scalars from the config:

* ``embedding_multiplier``: the input embeddings are multiplied by it;
* ``residual_multiplier``: each sublayer's output (attention, MLP) is multiplied by it before
  it is added to the residual stream, ``x + m * attn(norm(x))``, ``x + m * mlp(norm(x))``;
* ``attention_multiplier``: the q.k scale, instead of ``head_dim ** -0.5``;
* ``logits_scaling``: the logits are divided by it.

The residual multiplier is applied to the sublayer output itself (in the model's dtype, as HF
does) before the layer hands it on as ``add``; the add into the residual stream, plain or the
fused add+RMSNorm of :mod:`~modserve.core.models.cpu_fused`, then adds an already scaled tensor,
so every path (float32, bf16, the fused CPU ops, tensor parallelism: the scale follows the
all-reduce) needs no switch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from modserve.core.contract import AttentionBackend, CausalLM, ModelArchitecture, ModelSpec, hookimpl
from modserve.core.models import cpu_fused
from modserve.plugins.models.decoder import DecoderLM, PreNormLayer
from modserve.plugins.models.layers import MLP, Attention

MODSERVE_CONTRACT = "2.2"  # ModelSpec.attention_scale carries attention_multiplier


@dataclass
class GraniteSpec(ModelSpec):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


def _scaled(x: torch.Tensor, factor: float, fused: bool) -> torch.Tensor:
    """``x.mul_(factor)``; with the fused CPU ops on, as their kernel (a decode step stays recordable)."""
    return cpu_fused.scale_(x, factor) if fused else x.mul_(factor)


class GraniteLayer(PreNormLayer):
    """Llama's pre-norm layer whose sublayer outputs are scaled by ``residual_multiplier``."""

    fused = False  # set by DecoderLM.use_cpu_fused_ops

    def __init__(self, spec: GraniteSpec, attention: Attention, mlp: MLP) -> None:
        super().__init__(spec, attention, mlp)
        self.residual_multiplier = spec.residual_multiplier

    def forward(self, residual, add, cos, sin, cache, meta) -> torch.Tensor:
        m = self.residual_multiplier
        attn = self.self_attn.forward(self.input_layernorm.forward(residual, add), cos, sin, cache, meta)
        mlp = self.mlp.forward(self.post_attention_layernorm.forward(residual, _scaled(attn, m, self.fused)))
        return _scaled(mlp, m, self.fused)


class GraniteForCausalLM(DecoderLM):
    def __init__(self, spec: GraniteSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None):
        layers = [GraniteLayer(spec, Attention(spec, backend, tp), MLP(spec, tp)) for _ in range(num_layers or spec.num_layers)]
        super().__init__(spec, layers, max_positions, tp)
        self.embedding_multiplier = spec.embedding_multiplier
        self.logits_scaling = spec.logits_scaling

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings times ``embedding_multiplier`` (a Python float, as HF multiplies)."""
        return _scaled(super().embed(input_ids), self.embedding_multiplier, self.fused_lookups)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        out = super().compute_logits(hidden)
        if out is not None and self.logits_scaling != 1.0:
            out.div_(self.logits_scaling)
        return out


class Granite(ModelArchitecture):
    """IBM Granite: Llama with embedding, residual, attention and logits multipliers."""

    model_types = ("granite",)

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {act!r}; supported: silu")
        for key in ("attention_bias", "mlp_bias"):  # o_proj and the MLP would carry biases
            if hf_config.get(key):
                raise ValueError(f"{source}: {key} is not supported")
        spec = GraniteSpec(**vars(ModelSpec.from_hf_config(hf_config, source)))
        spec.embedding_multiplier = float(hf_config.get("embedding_multiplier", 1.0))
        spec.residual_multiplier = float(hf_config.get("residual_multiplier", 1.0))
        spec.logits_scaling = float(hf_config.get("logits_scaling", 1.0))
        spec.attention_scale = float(hf_config.get("attention_multiplier", 1.0))  # HF: 1.0 when absent, not 1/sqrt(d)
        return spec

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return GraniteForCausalLM(spec, attention, max_positions, num_layers, tp)


@hookimpl
def register_models():
    return {"granite": Granite}
