"""Gemma 2, Gemma 3 (text), Phi-3 and Granite from GGUF files laid out as llama.cpp's converter
(``convert_hf_to_gguf.py``: ``Gemma2Model``, ``Gemma3Model``, ``Phi3MiniModel``,
``GraniteModel``) writes them.

:func:`write_gguf_like_llama_cpp` mirrors the converter for these three (checked by hand
against its output on the same tiny checkpoints: the same metadata keys and values and the
same tensors, bit for bit, tokenizer aside): Gemma's norms stored as ``1 + weight``, Gemma 2's
``lm_head`` dropped (tied), no q/k permutation, Phi-3's fused ``attn_qkv`` / ``ffn_up`` and its
LongRoPE factors as ``rope_factors_{long,short}`` tensors, Granite's q/k rows permuted as
Llama's and its multipliers as ``granite.{embedding_scale,residual_scale,attention.scale,logit_scale}``. What the file cannot say the
checkpoints here set to what llama.cpp assumes: ``query_pre_attn_scalar = head_dim`` (not a
27B model) and Gemma 3's local/global pattern of 5:1 (six layers).

The oracle is transformers on the original safetensors checkpoint: greedy tokens, and every
prompt position's logprob, with prompts longer than the Gemmas' windows (12, 10). Past Phi-3's
original context (128 here: its long LongRoPE factors) the oracle is modserve serving the
safetensors checkpoint (there the phi3 plugin and transformers part ways, GGUF or not).
"""

from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from modserve import LLM, SamplingParams
from modserve.core.models.gguf_archs import arch_config
from modserve.core.models.gguf_reader import read_gguf
from tiny_models import build_model, hf_greedy, teacher_forced

GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "granite": "granite"}
# What llama.cpp cannot read from the file, set to what it assumes (module docstring)
OVERRIDES = {
    "gemma2": dict(tie_word_embeddings=True, query_pre_attn_scalar=64),
    "gemma3_text": dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=64),
    "phi3": {},
    "granite": {},
}
_NAMES = {  # HF layer module -> llama.cpp tensor (gguf-py's tensor_mapping for these archs)
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up fused, gate first, as HF stores it
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_gguf_like_llama_cpp(path, ckpt: str, quantize: T | None = None) -> str:
    """The GGUF llama.cpp's converter writes from the checkpoint ``ckpt`` (float32, or with
    every 2-D weight but the embedding in ``quantize`` blocks, as llama-quantize would)."""
    from safetensors.torch import load_file

    with open(os.path.join(ckpt, "config.json")) as f:
        hp = json.load(f)
    arch = GGUF_ARCH[hp["model_type"]]
    rope = hp.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    extra: dict[str, np.ndarray] = {}
    if arch in ("gemma2", "gemma3"):
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no RoPE keys (llama.cpp's default base, 10000)
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    elif arch == "gemma3":  # TextModel's RoPE keys (global: full_attention; local: freq_base_swa), then Gemma3Model's
        full, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
        if "rope_theta" in local:
            w.add_rope_freq_base_swa(local["rope_theta"])
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        w.add_sliding_window(hp["sliding_window"])
    elif arch == "granite":  # LlamaModel.set_gguf_parameters, then GraniteModel's multipliers
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_freq_base(hp.get("rope_theta") or rope.get("rope_theta", 10000.0))
        w.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
        w.add_attention_scale(hp["attention_multiplier"])
        w.add_embedding_scale(hp["embedding_multiplier"])
        w.add_residual_scale(hp["residual_multiplier"])
        w.add_logit_scale(hp["logits_scaling"])
    else:  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors: no rope.scaling.type for LongRoPE
        original = rope["original_max_position_embeddings"]
        rotated = int(rope.get("partial_rotary_factor", 1.0) * hp["hidden_size"]) // hp["num_attention_heads"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(rotated)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = hp["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    _tokenizer_metadata(w, ckpt, hp)
    for name, array in extra.items():
        w.add_tensor(name, array)
    for name, tensor in load_file(os.path.join(ckpt, "model.safetensors")).items():
        if name == "lm_head.weight" and arch == "gemma2":  # Gemma2Model.filter_tensors: tied in llama.cpp
            continue
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # Gemma*Model.modify_tensors
            tensor = tensor + 1
        if arch == "granite" and (".q_proj." in name or ".k_proj." in name):  # LlamaModel.modify_tensors
            tensor = _llama_permute(tensor, hp["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"])
        w_name = _gguf_name(name, arch)
        data = tensor.float().numpy()
        if quantize is not None and data.ndim == 2 and w_name != "token_embd.weight":
            w.add_tensor(w_name, gguf.quants.quantize(data, quantize), raw_dtype=quantize)
        else:
            w.add_tensor(w_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _llama_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """LlamaModel.permute: each head's two rotary halves interleaved, for llama.cpp's pairwise RoPE."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _gguf_name(hf_name: str, arch: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{kind}"
    _, _, layer, sub = module.split(".", 3)
    if sub == "post_attention_layernorm":  # Gemma: the attention output's norm; Phi-3: the pre-MLP norm
        return f"blk.{layer}.{'ffn_norm' if arch in ('phi3', 'granite') else 'post_attention_norm'}.{kind}"
    return f"blk.{layer}.{_NAMES[sub]}.{kind}"


def _tokenizer_metadata(w: gguf.GGUFWriter, ckpt: str, hp: dict) -> None:
    """The byte-level BPE vocabulary as the converter's ``_set_vocab_gpt2`` writes it."""
    with open(os.path.join(ckpt, "tokenizer.json")) as f:
        tok = json.load(f)
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    specials = {added["id"] for added in tok["added_tokens"] if added["special"]}
    by_id.update({added["id"]: added["content"] for added in tok["added_tokens"]})
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(hp["vocab_size"])]
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(hp["eos_token_id"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (the HF reference, the safetensors directory, its float32 GGUF)."""
    directory = tmp_path_factory.mktemp("gguf_more_archs")
    out = {}
    for model_type, overrides in OVERRIDES.items():
        hf = build_model(str(directory / model_type), model_type, **overrides)
        out[model_type] = (hf, str(directory / model_type), write_gguf_like_llama_cpp(directory / f"{model_type}.gguf", str(directory / model_type)))
    return out


def _prompts(model_type: str) -> list[list[int]]:
    long = list(range(100, 140)) if model_type not in ("phi3", "granite") else [(7 * i) % 380 + 3 for i in range(100)]
    return [[5, 17, 99, 3, 200, 41], [60, 61, 62], long]


@pytest.mark.parametrize("model_type", list(GGUF_ARCH))
def test_tensors_and_config_read_back_as_hf(checkpoints, model_type):
    hf, _, path = checkpoints[model_type]
    read = read_gguf(path)
    config = read.config
    assert config["model_type"] == model_type
    expected = hf.state_dict()
    tied = model_type in ("gemma2", "granite")
    assert config["tie_word_embeddings"] == tied
    assert set(read.tensors) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, tensor in read.tensors.items():  # Gemma's norms: (w + 1) - 1 in float32
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-7 if "norm" in name else 0, msg=name)
    hc = hf.config
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    assert (config["head_dim"], config["num_key_value_heads"], config["max_position_embeddings"]) == (head_dim, 2, 512)
    if model_type == "gemma2":
        assert config["layer_types"] == hc.layer_types == ["sliding_attention", "full_attention"]
        assert (config["sliding_window"], config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (12, 5.0, 8.0)
        assert (config["query_pre_attn_scalar"], config["rope_theta"]) == (64, 10000.0)
    elif model_type == "gemma3_text":
        assert config["layer_types"] == hc.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert (config["sliding_window"], config["query_pre_attn_scalar"], config["final_logit_softcapping"]) == (10, 64, None)
        assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10000.0)
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    elif model_type == "granite":  # q/k rows un-permuted (compared above), the multipliers read back
        scales = {k: config[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}
        assert scales == {"embedding_multiplier": 12.0, "residual_multiplier": pytest.approx(0.22),
                          "attention_multiplier": 0.03125, "logits_scaling": 8.0}
    else:
        assert "rope_factors_long.weight" not in read.tensors
        assert (config["partial_rotary_factor"], config["original_max_position_embeddings"], config["sliding_window"]) == (0.75, 128, None)
        scaling = config["rope_scaling"]
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 128
        assert scaling["long_factor"] == [2.0, 3.0, 4.0, 6.0, 8.0, 12.0]
        assert scaling["short_factor"] == pytest.approx([1.0, 1.1, 1.3, 1.6, 2.0, 2.5])
        assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(128)))


@pytest.mark.parametrize("model_type", list(GGUF_ARCH))
def test_gguf_serves_hf_greedy_tokens_and_logprobs(checkpoints, model_type):
    """The parity that fails if Gemma's stored ``1 + weight`` norms were read as they are
    (norm weights here are uniform in [-0.5, 0.5]), if a window, soft-cap, local RoPE base or
    the LongRoPE factors were lost, or Granite's q/k rows left permuted or a multiplier dropped."""
    hf, _, path = checkpoints[model_type]
    ps = _prompts(model_type)
    assert len(ps[-1]) > (getattr(hf.config, "sliding_window", None) or 64)
    llm = LLM(model=path, kv_cache={"plugin": "paged", "num_blocks": 64})
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in ps]
    out = llm.generate({"prompt_token_ids": ps[-1]}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ps[-1]])).logits[0].log_softmax(-1)
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        token = ps[-1][pos + 1]
        assert entry[token].logprob == pytest.approx(ref[pos, token].item(), abs=1e-4), pos


@pytest.mark.parametrize("model_type", list(GGUF_ARCH))
def test_q8_0_blocks_kept_for_the_new_archs(checkpoints, model_type, tmp_path):
    """``quantization: gguf`` keeps a Q8_0 file's blocks (Phi-3's fused qkv / gate-up too) and
    serves what the same file dequantized serves."""
    _, ckpt, _ = checkpoints[model_type]
    path = write_gguf_like_llama_cpp(tmp_path / "q8_0.gguf", ckpt, quantize=T.Q8_0)

    def llm(**device):
        return LLM(model=path, device={"plugin": "cpu", **device}, kv_cache={"plugin": "paged", "num_blocks": 64})

    ref = llm()
    ps = _prompts(model_type)
    outs = ref.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sequences = [p + o.outputs[0].token_ids for p, o in zip(ps, outs)]
    kept = llm(quantization="gguf")
    from modserve.plugins.platforms.cpu_quant import Int8GroupLinear

    model = kept.engine.c.runner.model
    assert sum(type(m) is Int8GroupLinear for m in model.layers.modules()) == 4 * len(model.layers)  # qkv, o, gate_up, down
    want, got = teacher_forced(ref, sequences), teacher_forced(kept, sequences)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) <= 1e-4


@pytest.mark.parametrize(
    "arch, layers, hidden, heads, head_dim, scalar",
    [("gemma2", 46, 4608, 32, 128, 144), ("gemma2", 42, 3584, 16, 256, 256), ("gemma3", 62, 5376, 32, 128, 168),
     ("gemma3", 34, 2560, 8, 256, 256)],
)
def test_query_pre_attn_scalar_follows_llama_cpp(arch, layers, hidden, heads, head_dim, scalar):
    """Not in the file: llama.cpp scales the 27B models by hidden / heads, the others by head_dim
    (Gemma 2 27B: 144, 9B: 256; Gemma 3 27B: 168, 4B: 256, as their config.json say)."""
    config = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim}
    got = arch_config({f"{arch}.attention.sliding_window": 4096}, arch, config, {})
    assert got["query_pre_attn_scalar"] == scalar
    every = 2 if arch == "gemma2" else 6
    assert [t == "full_attention" for t in got["layer_types"]] == [(i + 1) % every == 0 for i in range(layers)]


def test_phi3_long_rope_factors_past_the_original_context(checkpoints):
    """A 150-token prompt rotates with the long factors: the GGUF serves what the safetensors
    checkpoint serves."""
    _, ckpt, path = checkpoints["phi3"]
    p = [(7 * i) % 380 + 3 for i in range(150)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens(model) -> list[int]:
        return LLM(model=model, kv_cache={"plugin": "paged", "num_blocks": 64}).generate({"prompt_token_ids": p}, greedy)[0].outputs[0].token_ids

    assert tokens(path) == tokens(ckpt)
