"""Model plugin ``phi3``: Phi-3 and Phi-4-mini.

Llama's layer with the checkpoint's q/k/v and gate/up projections already fused
(``qkv_proj``, ``gate_up_proj``: loaded as they are), LongRoPE scaling, a partial rotary
factor (Phi-4-mini rotates 3/4 of each head) and a sliding window (``max_model_len`` must
stay within it).
"""

from __future__ import annotations

from typing import Any

from modserve.core.contract import AttentionBackend, CausalLM, ModelArchitecture, ModelSpec, hookimpl
from modserve.plugins.models.decoder import DecoderLM, llama_layers

MODSERVE_CONTRACT = "2.1"


class Phi3ForCausalLM(DecoderLM):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None):
        super().__init__(spec, llama_layers(spec, backend, tp, num_layers), max_positions, tp)


class Phi3(ModelArchitecture):
    model_types = ("phi3",)

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        return ModelSpec.from_hf_config(hf_config, source)

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return Phi3ForCausalLM(spec, attention, max_positions, num_layers, tp)

    def supports_tensor_parallel(self, spec: ModelSpec) -> bool:
        return False  # the checkpoint's fused projections would need their own shard plan


@hookimpl
def register_models():
    return {"phi3": Phi3}
