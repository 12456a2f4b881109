"""The Triton attention backend end to end: greedy tokens identical to HF transformers.

Runs the whole engine with ``attention: {plugin: triton}`` under the Triton interpreter on
a tiny random Llama with head size 64 (the kernels support 64 and 128): a ragged batch
with chunked prefill, a prefix-cache hit with split-K decode, and INT8 KV matching the
torch backend's INT8 KV token for token. Also the CPU selection rules of ``auto`` and the
start-up error for ``triton`` without the interpreter.
"""

import os
import sys

# Triton's interpreter only works if TRITON_INTERPRET=1 is set before triton is first
# imported (its own library functions are built then). Pytest imports every test module
# before running any test, so setting it here is early enough unless triton was already
# imported (building a transformers model imports it) without it.
_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import random

import pytest
import torch

pytest.importorskip("triton")

from tiny_models import hf_greedy  # noqa: E402
from tiny_models import build_model  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.core.engine_factory import resolve  # noqa: E402
from modserve.plugins.attention.cpu_backend import CpuAttention  # noqa: E402
from modserve.plugins.attention.triton_backend import TritonAttention  # noqa: E402

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Small tiles so prompts span several query and key tiles (each split-K partition costs
# interpreter time, so only the prefix-cache test turns it on).
TRITON = {"plugin": "triton", "prefill_block_m": 32, "block_n": 16}
SPLIT_K = {**TRITON, "decode_split_tokens": 32, "decode_max_splits": 2}
LENGTHS = (1, 5, 16, 17, 40, 70)  # one token, within a block, exactly a block, across blocks and tiles


@pytest.fixture(scope="module")
def interpreter():
    """Fail clearly (rather than deep inside a kernel) when this process cannot interpret Triton."""
    from modserve.plugins.attention import triton_kernels

    if _TRITON_IMPORTED_COMPILED or not triton_kernels.INTERPRETED:
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run here: "
            "export TRITON_INTERPRET=1 before running pytest, or run this module in its own process"
        )


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    """(path, hf_model): tiny Llama with 2 query heads sharing 1 KV head (MQA), head size 64."""
    path = str(tmp_path_factory.mktemp("llama_hd64"))
    hf = build_model(path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    assert hf.config.hidden_size // hf.config.num_attention_heads == 64
    return path, hf


def random_prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def make_llm(path: str, attention: dict, *, batched_tokens: int = 32, block_size: int = 16,
             num_blocks: int = 64, **kv) -> LLM:
    return LLM(
        {"model": {"path": path, "max_model_len": 256}},
        attention=attention,
        scheduler={"plugin": "fcfs", "max_num_batched_tokens": batched_tokens},
        kv_cache={"plugin": "paged", "block_size": block_size, "num_blocks": num_blocks, **kv},
    )


def test_mixed_batch_with_chunked_prefill_matches_hf(model64, interpreter):
    path, hf = model64
    llm = make_llm(path, TRITON)  # a budget of 32 tokens: the 40- and 70-token prompts are chunked
    assert isinstance(llm.engine.c.attention, TritonAttention)
    ps = random_prompts(hf.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, MAX_TOKENS), f"prompt of {len(p)} tokens diverged"
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(ps)  # the model is not degenerate


def test_prefix_cache_hit_and_split_k_decode_match_hf(model64, interpreter, monkeypatch):
    path, hf = model64
    llm = make_llm(path, SPLIT_K)  # decode contexts of 51-63 tokens: two partitions and a reduction
    kernels = llm.engine.c.attention.kernels
    splits = []

    def spy(*args, **kwargs):
        partials = kwargs.get("partials", args[7] if len(args) > 7 else None)
        splits.append(1 if partials is None else partials[0].shape[2])
        return decode_attention(*args, **kwargs)

    decode_attention = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", spy)
    shared = random_prompts(hf.config.vocab_size, (48,), seed=1)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12, 13]
    out1 = llm.generate({"prompt_token_ids": first}, GREEDY)[0]
    out2 = llm.generate({"prompt_token_ids": second}, GREEDY)[0]  # after the first has finished
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens == 48  # three full blocks of 16 read back through the block table
    assert out1.outputs[0].token_ids == hf_greedy(hf, first, MAX_TOKENS)
    assert out2.outputs[0].token_ids == hf_greedy(hf, second, MAX_TOKENS)
    assert splits and set(splits) == {2}


def test_int8_kv_triton_matches_int8_kv_torch(model64, interpreter):
    path, hf = model64
    ps = random_prompts(hf.config.vocab_size, (3, 20, 33, 64), seed=2)
    tokens = {}
    for name, attention in {"torch": {"plugin": "torch"}, "triton": TRITON}.items():
        llm = make_llm(path, attention, batched_tokens=24, block_size=32, num_blocks=32, kv_dtype="int8")
        assert llm.engine.kv.layer_caches()[0].k.dtype == torch.int8
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["triton"] == tokens["torch"]


def test_auto_attention_is_the_cpu_kernel_on_cpu(model64):
    """Not triton without CUDA (the fallback to torch without a compiler: test_cpu_attention)."""
    path, _ = model64
    for device in ("cpu", "auto"):
        resolved = resolve({"model": {"path": path}, "device": device, "attention": {"plugin": "auto"}})
        assert resolved.pipeline.attention["plugin"] == "cpu"
    kv = {"plugin": "paged", "num_blocks": 64}
    llm = LLM({"model": {"path": path}, "attention": {"plugin": "auto"}, "kv_cache": kv})
    assert isinstance(llm.engine.c.attention, CpuAttention)


def test_triton_on_cpu_without_interpreter_says_how_to_proceed(model64, monkeypatch):
    path, _ = model64
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kv = {"plugin": "paged", "num_blocks": 64}
    with pytest.raises(RuntimeError) as err:
        LLM({"model": {"path": path}, "attention": {"plugin": "triton"}, "kv_cache": kv})
    msg = str(err.value)
    assert "TRITON_INTERPRET=1" in msg and "attention: {plugin: torch}" in msg
