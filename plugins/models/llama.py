"""Model plugin ``llama``: the Llama-family decoder (Llama, Mistral, Qwen2).

Differences between the three are config switches (q/k/v bias, tied embeddings, head_dim,
RoPE scaling). The layers and the model body are shared with the other decoder plugins
(:mod:`~modserve.plugins.models.layers`, :mod:`~modserve.plugins.models.decoder`).
"""

from __future__ import annotations

from typing import Any

from modserve.core.contract import AttentionBackend, CausalLM, ModelArchitecture, ModelSpec, hookimpl
from modserve.plugins.models.decoder import DecoderLM, llama_layers

MODSERVE_CONTRACT = "2.0"


class LlamaForCausalLM(DecoderLM):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None):
        super().__init__(spec, llama_layers(spec, backend, tp, num_layers), max_positions, tp)


class LlamaFamily(ModelArchitecture):
    """Llama, Mistral and Qwen2: the differences are config switches (q/k/v bias, tied
    embeddings, head_dim, RoPE scaling)."""

    model_types = ("llama", "mistral", "qwen2")

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        return ModelSpec.from_hf_config(hf_config, source)

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return LlamaForCausalLM(spec, attention, max_positions, num_layers, tp)


@hookimpl
def register_models():
    return {"llama": LlamaFamily}
