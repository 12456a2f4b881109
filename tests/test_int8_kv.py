"""INT8 KV cache (``kv_cache: {plugin: paged, kv_dtype: int8}``): quality, capacity, accounting.

- Quality on SmolLM2, teacher-forced over a few hundred tokens of English: top-1 agreement
  with full-precision KV at >= 98% of positions and perplexity rise < 2% (the figures are
  printed; ``benchmarks/int8_kv_capacity.py`` prints them too).
- Capacity: under one ``memory_gb`` budget INT8 holds ~3.76x the blocks of fp32 (head size
  64: 64 int8 bytes + a 4-byte scale per token and head, against 256 bytes).
- Block accounting stays exact with prefix caching and preemption.
"""

from __future__ import annotations

import collections
import contextlib
import random
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.contract import KVSpec
from modserve.core.plugin_manager import default_registry, standalone_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import int8_quality  # noqa: E402

BUDGET_GB = 0.25


@contextlib.contextmanager
def token_budget(llm: LLM, max_num_batched_tokens: int):
    """Run the shared fp32 SmolLM2 engine with the same prefill chunk size as the INT8 one."""
    scheduler = llm.engine.scheduler
    saved = scheduler.config
    scheduler.config = msgspec.structs.replace(saved, max_num_batched_tokens=max_num_batched_tokens)
    try:
        yield llm
    finally:
        scheduler.config = saved


@pytest.fixture(scope="module")
def smollm2_int8_llm():
    llm = LLM(int8_quality.smollm2_config("int8"))
    cache = llm.engine.kv.layer_caches()[0]
    assert cache.k.dtype == torch.int8 and cache.v.dtype == torch.int8 and cache.k_scale.dtype == torch.float32
    return llm


def test_int8_kv_quality_on_smollm2(smollm2_llm, smollm2_int8_llm):
    token_ids = smollm2_llm.tokenizer.encode(int8_quality.TEXT)
    assert 300 <= len(token_ids) <= 500
    with token_budget(smollm2_llm, int8_quality.CHUNK_TOKENS) as fp32_llm:
        ref = int8_quality.teacher_forced(fp32_llm, token_ids)
    test = int8_quality.teacher_forced(smollm2_int8_llm, token_ids)
    q = int8_quality.compare(ref, test)
    print("\n" + q.summary())
    assert ref.logprobs != test.logprobs  # the KV really was quantized
    assert q.agreement >= 0.98
    assert q.ppl_rise < 0.02
    assert q.ppl_ref < 100  # the text is ordinary English for the model, not noise


def _paged_backend(options: dict, spec: KVSpec):
    cls, cfg = default_registry().resolve("kv_cache", {"plugin": "paged", **options})
    return cls(cfg, standalone_context(kv_spec=spec))


def _allocated_bytes(kv) -> int:
    return sum(
        t.numel() * t.element_size()
        for c in kv.layer_caches()
        for t in (c.k, c.v, c.k_scale, c.v_scale)
        if t is not None
    )


def test_int8_fits_3_7x_the_blocks_of_fp32_in_the_same_budget(smollm2_llm):
    m = smollm2_llm.engine.c.spec  # SmolLM2: 30 layers, 3 KV heads of 64
    budget = BUDGET_GB * 2**30
    kvs = {}
    settings = (("fp32", torch.float32, "auto"), ("bf16", torch.bfloat16, "auto"), ("int8", torch.float32, "int8"))
    for name, dtype, kv_dtype in settings:
        spec = KVSpec(m.num_layers, m.num_kv_heads, m.head_dim, dtype, torch.device("cpu"), 2048)
        kv = kvs[name] = _paged_backend({"memory_gb": BUDGET_GB, "kv_dtype": kv_dtype}, spec)
        allocated = _allocated_bytes(kv)
        assert allocated <= budget
        assert allocated + allocated / kv.num_blocks > budget  # one more block would not fit
    gain = kvs["int8"].num_blocks / kvs["fp32"].num_blocks
    per_head = 4 * m.head_dim / (m.head_dim + 4)  # fp32 bytes / (int8 bytes + fp32 scale)
    blocks = ", ".join(f"{n} {kv.num_blocks}" for n, kv in kvs.items())
    print(f"\nblocks in {BUDGET_GB} GB: {blocks}; int8/fp32 {gain:.3f}x")
    assert gain == pytest.approx(per_head, rel=0.01) and 3.7 < gain < 3.8
    assert kvs["int8"].num_blocks / kvs["bf16"].num_blocks == pytest.approx(per_head / 2, rel=0.01)


def _check_block_accounting(engine) -> None:
    """Every block a request holds has exactly one ref per holder; all others are free."""
    kv, pool = engine.kv, engine.kv.pool
    held = collections.Counter(b for req in engine.requests.values() for b in kv.block_table(req))
    for block, holders in held.items():
        assert pool.ref_cnt[block] == holders, f"block {block}: ref count {pool.ref_cnt[block]}, {holders} holders"
    assert sum(pool.ref_cnt) == sum(held.values())
    assert kv.num_free_blocks == kv.num_blocks - len(held)


def _run(engine, prompts: list[list[int]], params: SamplingParams, late: int) -> dict[str, list[int]]:
    """Submit all but the last ``late`` prompts, then those once the first request finished."""
    done: dict[str, list[int]] = {}
    for i, p in enumerate(prompts[:-late]):
        engine.add_request(p, params, request_id=str(i))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        _check_block_accounting(engine)
        if done and late:
            for i, p in enumerate(prompts[-late:], start=len(prompts) - late):
                engine.add_request(p, params, request_id=str(i))
            late = 0
    return done


def test_int8_greedy_keeps_block_accounting_exact_with_prefix_hits_and_preemption(tiny_llama):
    path, hf = tiny_llama
    rng = random.Random(3)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # prompts share 1, 2 or 2.5 blocks of it
    prompts = [
        shared[: rng.choice((16, 33, 40))] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        for _ in range(10)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def engine(num_blocks: int, prefix_caching: bool):
        return LLM(
            {"model": {"path": path, "max_model_len": 160}},
            scheduler={"plugin": "fcfs", "max_num_batched_tokens": 48},
            kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": num_blocks, "kv_dtype": "int8",
                      "prefix_caching": prefix_caching},
        ).engine

    tight = engine(12, True)
    got = _run(tight, prompts, params, late=3)
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.stats().prefix_hits > 0
    roomy = engine(256, False)
    want = _run(roomy, prompts, params, late=3)
    assert roomy.scheduler.num_preemptions == 0
    assert got == want  # recompute and shared int8 blocks give the very same tokens
    assert all(len(t) == 24 for t in got.values())
