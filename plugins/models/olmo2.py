"""Model plugin ``olmo2``: OLMo 2, whose layers normalise sublayer outputs instead of inputs.

``x + post_attention_norm(attn(x))``, then ``x + post_feedforward_norm(mlp(x))``, with an
RMSNorm over the whole q and k projections (not per head) before RoPE.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from modserve.core.contract import AttentionBackend, CausalLM, ModelArchitecture, ModelSpec, hookimpl
from modserve.plugins.models.decoder import DecoderLM
from modserve.plugins.models.layers import MLP, Attention, RMSNorm

MODSERVE_CONTRACT = "2.1"


class PostNormLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(spec, backend, qk_norm="full")
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, residual, add, cos, sin, cache, meta) -> None:
        """Both normed sublayer outputs go into ``residual`` here (one kernel each when fused),
        so nothing is handed to the next layer: ``add`` is always None."""
        self.post_attention_layernorm.add_normed_(residual, self.self_attn.forward(residual, cos, sin, cache, meta))
        self.post_feedforward_layernorm.add_normed_(residual, self.mlp.forward(residual))


class Olmo2ForCausalLM(DecoderLM):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None):
        super().__init__(spec, [PostNormLayer(spec, backend) for _ in range(num_layers or spec.num_layers)], max_positions, tp)


class Olmo2(ModelArchitecture):
    model_types = ("olmo2",)

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        return ModelSpec.from_hf_config(hf_config, source)

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return Olmo2ForCausalLM(spec, attention, max_positions, num_layers, tp)

    def supports_tensor_parallel(self, spec: ModelSpec) -> bool:
        return False  # the q/k norm spans all heads, so a rank's shard cannot compute it alone


@hookimpl
def register_models():
    return {"olmo2": Olmo2}
