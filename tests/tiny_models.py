"""Tiny random checkpoints of every served architecture with a real byte-level BPE tokenizer.

Built offline with ``transformers`` config classes and ``save_pretrained``; the HF model
object is returned too, as the reference oracle.
"""

from __future__ import annotations

import json
import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n" * 4,
    "Hello, world! Привет, мир! 你好，世界! café naïve 😀 " * 4,
    "Once upon a time there was a small model that served tokens very fast. " * 4,
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(path: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}, f)
    return tok


def build_model(path: str, arch: str = "llama", seed: int = 0, **overrides):
    """Save a tiny random checkpoint to ``path``; return the HF model (float32, eval)."""
    import transformers

    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer(path)
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=0,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**common, "tie_word_embeddings": True, **overrides})
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**{**common, "sliding_window": None, "head_dim": 32, **overrides})
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": False, **overrides})
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": True, **overrides})
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**common, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": True,
                                             **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**{**common, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})
        cls = transformers.MixtralForCausalLM
    elif arch == "olmo2":
        cfg = transformers.Olmo2Config(**{**common, **overrides})
        cls = transformers.Olmo2ForCausalLM
    elif arch == "phi3":
        cfg = transformers.Phi3Config(**{**common, "pad_token_id": 0, "original_max_position_embeddings": 128,
                                         "partial_rotary_factor": 0.75,
                                         "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                          "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0]},
                                         **overrides})
        cls = transformers.Phi3ForCausalLM
    elif arch == "gemma2":  # a window of 12 on layer 0, strong soft-caps so that both matter
        cfg = transformers.Gemma2Config(**{**common, "head_dim": 64, "tie_word_embeddings": False, "sliding_window": 12, "query_pre_attn_scalar": 48,
                                           "attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0, **overrides})
        cls = transformers.Gemma2ForCausalLM
    elif arch == "gemma3_text":  # two local layers (window 10, RoPE base 10k) and a global one (1M, linear x2)
        cfg = transformers.Gemma3TextConfig(**{
            **common, "num_hidden_layers": 3, "head_dim": 64, "tie_word_embeddings": False, "sliding_window": 10, "query_pre_attn_scalar": 48,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}},
            **overrides})
        cls = transformers.Gemma3ForCausalLM
    elif arch == "granite":  # multipliers far from 1 (and a q.k scale twice 1/head_dim) so that each matters
        cfg = transformers.GraniteConfig(**{**common, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
                                            "residual_multiplier": 0.22, "attention_multiplier": 0.015625 * 2,
                                            "logits_scaling": 8.0, **overrides})
        cls = transformers.GraniteForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # larger weights than the default init give peaky, diverse greedy outputs
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif p.dim() == 1 and arch == "qwen2":
                p.normal_(0, 0.1) if p.shape[0] != cfg.hidden_size else p.fill_(1.0)
            elif p.dim() == 1 and arch in ("qwen3", "qwen3_moe", "olmo2"):  # the q/k and post norms: not all ones
                p.uniform_(0.5, 1.5)
            elif p.dim() == 1 and arch.startswith("gemma"):  # Gemma's norms scale by 1 + weight
                p.uniform_(-0.5, 0.5)
        if arch == "granite":  # scaled embeddings as large as the other models': else they swamp the layers
            model.model.embed_tokens.weight.div_(cfg.embedding_multiplier)
    model.save_pretrained(path)
    return model.eval()


def interpreted_triton_llama(tmp_path_factory, triton_imported_compiled: bool) -> str:
    """A tiny Llama with head size 64 (a size the Triton kernels take), for a module that runs
    Triton interpreted; ``triton_imported_compiled``: the module found triton imported before it
    set ``TRITON_INTERPRET=1``, which the interpreter cannot undo (so the test fails, not runs
    compiled kernels on a CPU)."""
    import pytest

    if triton_imported_compiled:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; run this module in its own process")
    path = str(tmp_path_factory.mktemp("llama_hd64"))
    build_model(path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return path


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """The oracle: HF ``generate``'s greedy tokens, exactly ``n`` of them (EOS does not stop it)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def prompts(vocab: int, count: int = 12, seed: int = 0) -> list[list[int]]:
    """Random token prompts of 1-69 tokens (no special tokens: ids below 3 are left out)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 70))] for _ in range(count)]


def teacher_forced(llm, sequences: list[list[int]]) -> list[tuple[int, float]]:
    """Per position of each sequence after its first: (the model's likeliest token there, the
    logprob it gives the sequence's actual token), from one prompt_logprobs pass."""
    from modserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=1))
    preds = []
    for seq, out in zip(sequences, outs):
        for i, lps in enumerate(out.prompt_logprobs):
            if lps is not None:
                preds.append((max(lps.values(), key=lambda lp: lp.logprob).token_id, lps[seq[i]].logprob))
    return preds
