"""Model plugin ``gemma``: Gemma 2 and Gemma 3 (text).

Both are Llama-like decoders with Gemma's switches: embeddings scaled by ``sqrt(hidden)``
(in the model's dtype), RMSNorms that scale by ``1 + weight``, a norm before *and* after
each sublayer (``input`` / ``post_attention`` and ``pre_feedforward`` / ``post_feedforward``),
a GeGLU MLP (``gelu_pytorch_tanh``), q.k scaled by ``query_pre_attn_scalar ** -0.5``, and
layers that alternate between a sliding window (``layer_types`` ``sliding_attention``) and
full causal attention, served through the attention backend's per-layer view
(:meth:`~modserve.core.contract.AttentionBackend.for_layer`).

* Gemma 2: attention scores soft-capped at ``attn_logit_softcapping`` (inside the attention
  kernels) and the logits at ``final_logit_softcapping``; every other layer is local.
* Gemma 3 (``gemma3_text``): per-head q/k RMSNorms, five local layers to a global one, and
  per-layer RoPE: local layers rotate with ``rope_local_base_freq`` (the ``sliding_attention``
  RoPE parameters), global ones with ``rope_theta`` and its scaling.

A multimodal ``gemma3`` checkpoint (vision tower + ``text_config``) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modserve.core.contract import AttentionBackend, CausalLM, ModelArchitecture, ModelSpec, hookimpl
from modserve.core.models.rope import RotaryTable
from modserve.plugins.models.decoder import DecoderLM
from modserve.plugins.models.layers import MLP, Attention, RMSNorm

MODSERVE_CONTRACT = "2.2"  # its layers ask their attention backend for_layer

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class GemmaSpec(ModelSpec):
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE (None: as the global layers)
    local_rope_scaling: dict[str, Any] | None = None


class GemmaLayer(nn.Module):
    """``x + post_attn_norm(attn(input_norm(x)))``, then ``x + post_ffw_norm(mlp(pre_ffw_norm(x)))``."""

    def __init__(self, spec: ModelSpec, attention: Attention, mlp: MLP) -> None:
        super().__init__()
        size, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(size, eps, unit_offset=True)

    def forward(self, residual, add, cos, sin, cache, meta) -> torch.Tensor:
        attn = self.self_attn.forward(self.input_layernorm.forward(residual, add), cos, sin, cache, meta)
        h = self.pre_feedforward_layernorm.forward(residual, self.post_attention_layernorm.forward(attn))
        return self.post_feedforward_layernorm.forward(self.mlp.forward(h))


class GemmaForCausalLM(DecoderLM):
    def __init__(self, spec: GemmaSpec, backend: AttentionBackend, max_positions: int, num_layers: int | None = None, tp=None):
        qk_norm = "head" if spec.model_type == "gemma3_text" else None
        layers = [
            GemmaLayer(spec, Attention(spec, backend, tp, qk_norm, norm_offset=True), MLP(spec, tp, activation="gelu_tanh"))
            for _ in range(num_layers or spec.num_layers)
        ]
        super().__init__(spec, layers, max_positions, tp, embed_scale=spec.hidden_size**0.5, norm_offset=True,
                         final_logit_softcap=spec.final_logit_softcap)
        # layers that rotate with the local RoPE table
        self.local_rope = [spec.local_rope_theta is not None and spec.layer_window(i) is not None
                           for i in range(len(self.layers))]
        self.rotary_local: RotaryTable | None = None

    def to_device(self, device: torch.device, dtype: torch.dtype) -> GemmaForCausalLM:
        super().to_device(device, dtype)
        s = self.spec
        if any(self.local_rope):
            self.rotary_local = RotaryTable(s.head_dim, self.max_positions, s.local_rope_theta, s.local_rope_scaling, device)
        return self

    def forward(self, input_ids, positions, caches, meta) -> torch.Tensor:
        residual = self.embed(input_ids)
        rope = self.rotary_rows(self.rotary, positions, residual.dtype, meta)
        local = self.rotary_rows(self.rotary_local, positions, residual.dtype, meta) if self.rotary_local is not None else rope
        add = None
        for layer, cache, is_local in zip(self.layers, caches, self.local_rope):
            cos, sin = local if is_local else rope
            add = layer.forward(residual, add, cos, sin, cache, meta)
        return self.norm.forward(residual, add)


def _layer_types(cfg: dict[str, Any], model_type: str) -> list[str]:
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if model_type == "gemma2":  # every other layer, from the first, is local
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


class Gemma(ModelArchitecture):
    model_types = ("gemma2", "gemma3_text", "gemma3")

    def spec(self, hf_config: dict[str, Any], source: str) -> ModelSpec:
        model_type = hf_config.get("model_type")
        if model_type == "gemma3":
            raise ValueError(
                f"{source}: multimodal gemma3 checkpoints (a vision tower and a text_config) are not supported; "
                "serve a text-only gemma3_text checkpoint (Gemma3ForCausalLM)"
            )
        act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{source}: unsupported hidden_activation {act!r}; supported: gelu_pytorch_tanh")
        rope = hf_config.get("rope_parameters") or {}
        per_type = isinstance(rope, dict) and (FULL in rope or SLIDING in rope)
        cfg = dict(hf_config)
        local_theta, local_scaling = None, None
        if model_type == "gemma3_text":
            if per_type:  # transformers 5: RoPE parameters per layer type
                cfg["rope_parameters"] = rope.get(FULL)
                local = ModelSpec.from_hf_config({**hf_config, "rope_parameters": rope.get(SLIDING)}, source)
                local_theta, local_scaling = local.rope_theta, local.rope_scaling
            else:  # the hub's config.json: rope_theta (+ rope_scaling) global, rope_local_base_freq local
                local_theta = float(hf_config.get("rope_local_base_freq", 10000.0))
        elif per_type:
            cfg["rope_parameters"] = rope.get(FULL)
        base = ModelSpec.from_hf_config(cfg, source)
        spec = GemmaSpec(**vars(base))
        types = _layer_types(hf_config, model_type)
        window = hf_config.get("sliding_window")
        if window is not None and SLIDING in types:
            spec.sliding_window = int(window)
            spec.sliding_window_layers = tuple(i for i, t in enumerate(types) if t == SLIDING)
        else:
            spec.sliding_window = None
        spec.attention_scale = float(hf_config.get("query_pre_attn_scalar") or spec.head_dim) ** -0.5
        spec.attn_logit_softcap = hf_config.get("attn_logit_softcapping")
        spec.final_logit_softcap = hf_config.get("final_logit_softcapping")
        spec.local_rope_theta, spec.local_rope_scaling = local_theta, local_scaling
        return spec

    def build(self, spec: ModelSpec, attention: AttentionBackend, max_positions: int, num_layers: int | None, tp: Any) -> CausalLM:
        return GemmaForCausalLM(spec, attention, max_positions, num_layers, tp)

    def supports_tensor_parallel(self, spec: ModelSpec) -> bool:
        return False  # not tested sharded yet


@hookimpl
def register_models():
    return {"gemma": Gemma}
