"""Model plugin ``mixtral``: Mixtral, Llama's attention with a mixture of 8 experts (top 2) in
every layer, named ``block_sparse_moe`` with ``w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

from __future__ import annotations

from typing import Any

from modserve.core.contract import AttentionBackend, CausalLM, ModelArchitecture, ModelSpec, hookimpl
from modserve.core.contract.model_spec import MoESpec
from modserve.plugins.models.decoder import DecoderLM, PreNormLayer
from modserve.plugins.models.layers import Attention
from modserve.plugins.models.moe import SparseMoE, expert_route, experts_capturable

MODSERVE_CONTRACT = "2.8"  # its experts are ExpertMLP modules

_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}  # HF, GGUF


class MixtralForCausalLM(DecoderLM):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None):
        layers = [PreNormLayer(spec, Attention(spec, backend, tp), SparseMoE(spec)) for _ in range(num_layers or spec.num_layers)]
        super().__init__(spec, layers, max_positions, tp)

    @property
    def capturable(self) -> bool:  # where the platform's experts are (SparseMoE sizes its batches on the host)
        return experts_capturable(self)

    def route(self, name: str):
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")  # layers.3.mlp.experts.7.w1.weight
        if len(parts) == 7 and parts[3] == "experts":
            return expert_route(".".join(parts[:3]), parts[4], _PROJ[parts[5]], self.spec.moe.intermediate_size)
        return super().route(name)


class Mixtral(ModelArchitecture):
    model_types = ("mixtral",)

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        spec = ModelSpec.from_hf_config(hf_config, source)
        spec.moe = MoESpec(hf_config["num_local_experts"], hf_config["num_experts_per_tok"], spec.intermediate_size, True)
        return spec

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return MixtralForCausalLM(spec, attention, max_positions, num_layers, tp)

    def supports_tensor_parallel(self, spec: ModelSpec) -> bool:
        return False  # experts are not sharded


@hookimpl
def register_models():
    return {"mixtral": Mixtral}
