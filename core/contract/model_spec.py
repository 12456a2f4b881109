"""The model's shape, read from an HF ``config.json`` dict (GGUF metadata is mapped to one).

Model plugins return it from ``ModelArchitecture.spec``; attention, KV and samplers read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

@dataclass
class MoESpec:
    """A mixture-of-experts MLP: each token goes to its ``top_k`` experts of ``num_experts``."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool  # renormalise the chosen experts' router weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP instead (Qwen3-MoE's mlp_only_layers)


@dataclass
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    rotary_dim: int | None = None  # channels of each head that rotate (None: all of head_dim)
    moe: MoESpec | None = None  # a mixture-of-experts MLP (None: dense)
    # Which layers use ``sliding_window`` (None: all of them, when it is set); Gemma alternates.
    sliding_window_layers: tuple[int, ...] | None = None
    attention_scale: float | None = None  # q.k scale (None: head_dim ** -0.5); Gemma's query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(s / cap) before softmax (Gemma 2)

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.sliding_window_layers is None or layer in self.sliding_window_layers else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
        """Read a decoder-only HF config (Llama-style keys); an architecture plugin checks its own
        ``model_type`` and settings first."""
        model_type = cfg.get("model_type")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear", "longrope"):
            raise ValueError(f"{source}: unsupported rope type {rope_type!r}; supported: default, llama3, linear, longrope")
        if rope_type == "longrope":  # Phi-3: the factor follows from the context lengths unless given
            original = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
            rope["original_max_position_embeddings"] = original
            rope.setdefault("factor", cfg.get("max_position_embeddings", original) / original)
        eos = cfg.get("eos_token_id")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type in ("mistral", "phi3")) else None
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            sliding_window=sliding,
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id"),
            rotary_dim=int(head_dim * partial) if partial < 1.0 else None,
        )
