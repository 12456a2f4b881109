"""What llama.cpp's converter (``convert_hf_to_gguf.py``) writes differently per architecture,
undone for :mod:`~modserve.core.models.gguf_reader`.

* Gemma 2 / Gemma 3 (``gemma2``, ``gemma3``): every ``*norm.weight`` is stored as ``1 + weight``
  (the converter folds in Gemma's ``(1 + w)`` RMSNorm scale), so it is read back as stored - 1;
  ``ffn_norm`` is the pre-feed-forward norm (``post_attention_norm`` / ``post_ffw_norm`` the
  sublayer-output ones); no q/k row permutation (llama.cpp rotates Gemma NEOX-style). Neither
  the layer pattern nor ``query_pre_attn_scalar`` is in the file: llama.cpp makes every 2nd
  (Gemma 2) / 6th (Gemma 3) layer global and scales q.k by ``head_dim ** -0.5``, or by
  ``(hidden / heads) ** -0.5`` for the 27B models (recognised by their block count), and so
  does this reader. Gemma 3's local layers rotate with ``rope.freq_base_swa`` (written by
  newer converters; llama.cpp's default, 10000, otherwise), its global ones with
  ``rope.freq_base`` and the file's rope scaling.
* Phi-3 (``phi3``): q/k/v fused in ``attn_qkv`` and gate/up in ``ffn_up`` (loaded fused, as
  the HF ``qkv_proj`` / ``gate_up_proj``); ``rope.dimension_count`` is the rotated part of a
  head (Phi-4-mini: 3/4); LongRoPE is not a ``rope.scaling.type`` but two 1-D tensors,
  ``rope_factors_long`` / ``rope_factors_short``, read into ``rope_scaling``, with
  ``rope.scaling.original_context_length`` / ``attn_factor``; ``attention.sliding_window`` 0
  means none.
* Granite (``granite``): written as Llama (``GraniteModel`` extends ``LlamaModel``: q/k rows
  permuted, undone as for ``llama``), plus its four multipliers as ``granite.embedding_scale``,
  ``granite.residual_scale``, ``granite.attention.scale`` and ``granite.logit_scale`` (each
  written only when set; absent, Granite's default, 1.0).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf.quants import dequantize

from modserve.core.models.gguf_file import GGUFTensorInfo

# GGUF general.architecture -> HF model_type (a llama file with experts is Mixtral)
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "olmo2": "olmo2",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "granite": "granite",
}
# Architectures whose q/k rows the converter permutes for llama.cpp's pairwise RoPE (LlamaModel.permute)
ROPE_PERMUTED = ("llama", "granite")

# Layer tensors whose HF name is not the Llama-family one the reader assumes
LAYER_TENSORS = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Tensors that are settings, not weights: read into the config
CONFIG_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}
NORM_PLUS_ONE = ("gemma2", "gemma3")  # the converter stores Gemma's RMSNorm weights as 1 + weight

SLIDING, FULL = "sliding_attention", "full_attention"
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B, scaled by hidden / heads


def is_config_tensor(arch: str, name: str) -> bool:
    return name in CONFIG_TENSORS.get(arch, ())


def stored_norm_offset(arch: str, gguf_name: str) -> float:
    """What the converter added to this tensor (1 for Gemma's norms, else 0)."""
    return 1.0 if arch in NORM_PLUS_ONE and gguf_name.endswith("norm.weight") else 0.0


def arch_config(meta: dict[str, Any], arch: str, config: dict[str, Any], tensors: dict[str, GGUFTensorInfo]) -> dict[str, Any]:
    """HF config keys beyond the Llama-family ones ``gguf_reader._config`` reads (to update it with)."""
    if arch in _GEMMA_GLOBAL_EVERY:
        return _gemma(meta, arch, config)
    if arch == "phi3":
        return _phi3(meta, config, tensors)
    if arch == "granite":
        return {hf: float(meta.get(f"granite.{key}", 1.0)) for key, hf in _GRANITE_SCALES.items()}
    return {}


_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                   "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}


def _gemma(meta: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_GLOBAL_EVERY[arch])
    if isinstance(pattern, list):  # one flag per layer: is it local
        types = [SLIDING if local else FULL for local in pattern]
    else:
        types = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(layers)]
    if layers == _GEMMA_27B_BLOCKS[arch]:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    extra = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": meta.get(f"{arch}.attention.sliding_window") or None,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
    }
    if arch == "gemma3":
        extra["rope_local_base_freq"] = float(meta.get("gemma3.rope.freq_base_swa", 10000.0))
    return extra


def _phi3(meta: dict[str, Any], config: dict[str, Any], tensors: dict[str, GGUFTensorInfo]) -> dict[str, Any]:
    head_dim = config["hidden_size"] // config["num_attention_heads"]  # rope.dimension_count is the rotated part
    extra: dict[str, Any] = {"head_dim": head_dim, "sliding_window": meta.get("phi3.attention.sliding_window") or None}
    rotated = meta.get("phi3.rope.dimension_count", head_dim)
    if rotated != head_dim:
        extra["partial_rotary_factor"] = rotated / head_dim
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original:
        extra["original_max_position_embeddings"] = original
    long, short = (tensors.get(name) for name in CONFIG_TENSORS["phi3"])
    if long is not None and short is not None:
        scaling = {
            "rope_type": "longrope",
            "long_factor": _values(long),
            "short_factor": _values(short),
            "original_max_position_embeddings": original or config["max_position_embeddings"],
        }
        attn_factor = meta.get("phi3.rope.scaling.attn_factor")
        if attn_factor:
            scaling["attention_factor"] = attn_factor
        extra["rope_scaling"] = scaling
    return extra


def _values(tensor: GGUFTensorInfo) -> list[float]:
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).ravel().tolist()
