"""Model plugin ``qwen3``: Qwen3 (dense) and Qwen3-MoE.

Qwen3 is Llama with an RMSNorm on each head of q and k before RoPE (``q_norm``, ``k_norm``)
and no q/k/v bias. Qwen3-MoE replaces the MLP of its sparse layers with a mixture of
experts (every ``decoder_sparse_step``-th layer, except ``mlp_only_layers``).
"""

from __future__ import annotations

from typing import Any

from modserve.core.contract import AttentionBackend, CausalLM, ModelArchitecture, ModelSpec, hookimpl
from modserve.core.contract.model_spec import MoESpec
from modserve.plugins.models.decoder import DecoderLM, PreNormLayer
from modserve.plugins.models.layers import MLP, Attention
from modserve.plugins.models.moe import SparseMoE, expert_route, experts_capturable

MODSERVE_CONTRACT = "2.8"  # its experts are ExpertMLP modules


class Qwen3ForCausalLM(DecoderLM):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None):
        dense = spec.moe is None
        layers = [
            PreNormLayer(spec, Attention(spec, backend, tp, qk_norm="head"),
                         MLP(spec, tp) if dense or i in spec.moe.dense_layers else SparseMoE(spec))
            for i in range(num_layers or spec.num_layers)
        ]
        super().__init__(spec, layers, max_positions, tp)

    @property
    def capturable(self) -> bool:  # dense, or where the platform's experts are (SparseMoE sizes its batches on the host)
        return experts_capturable(self)

    def route(self, name: str):
        parts = name.split(".")  # layers.3.mlp.experts.7.gate_proj.weight
        if len(parts) == 7 and parts[3] == "experts":
            return expert_route(".".join(parts[:3]), parts[4], parts[5].removesuffix("_proj"), self.spec.moe.intermediate_size)
        return super().route(name)


class Qwen3(ModelArchitecture):
    model_types = ("qwen3", "qwen3_moe")

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        spec = ModelSpec.from_hf_config(hf_config, source)
        if hf_config.get("model_type") == "qwen3_moe":
            step = hf_config.get("decoder_sparse_step", 1)
            only_mlp = set(hf_config.get("mlp_only_layers") or [])
            dense = tuple(i for i in range(spec.num_layers) if i in only_mlp or (i + 1) % step)
            experts = hf_config.get("num_experts") or hf_config["num_local_experts"]  # the hub name, then transformers 5's
            spec.moe = MoESpec(experts, hf_config["num_experts_per_tok"],
                               hf_config["moe_intermediate_size"], bool(hf_config.get("norm_topk_prob", True)), dense)
        return spec

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return Qwen3ForCausalLM(spec, attention, max_positions, num_layers, tp)

    def supports_tensor_parallel(self, spec: ModelSpec) -> bool:
        return spec.moe is None  # experts are not sharded


@hookimpl
def register_models():
    return {"qwen3": Qwen3}
