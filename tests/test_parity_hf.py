"""Token-for-token identity with HF transformers (the oracle) on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from modserve import LLM, SamplingParams
from tiny_models import hf_greedy, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_batch_of_prompts_matches_hf(tiny_models, arch):
    path, hf = tiny_models[arch]
    llm = LLM(model=path, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 256})
    ps = prompts(hf.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    distinct = set()
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), f"prompt of {len(p)} tokens diverged"
        assert o.outputs[0].finish_reason == "length"
        distinct.add(tuple(o.outputs[0].token_ids))
    assert len(distinct) > 6  # the test model is not degenerate


def test_requests_added_mid_decode_match_hf(tiny_models):
    path, hf = tiny_models["qwen2"]
    llm = LLM(model=path, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 256},
              scheduler={"plugin": "fcfs", "max_num_batched_tokens": 64})
    engine = llm.engine
    ps = prompts(hf.config.vocab_size, count=8, seed=1)
    done = {}
    for i, p in enumerate(ps[:4]):
        engine.add_request(p, GREEDY, request_id=str(i))
    for _ in range(5):
        for out in engine.step():
            done[out.request_id] = out
    assert engine.scheduler.stats().num_running == 4
    for i, p in enumerate(ps[4:], start=4):
        engine.add_request(p, GREEDY, request_id=str(i))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for i, p in enumerate(ps):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, p, 24)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_match_hf_within_fp32_rounding(tiny_models, arch):
    """Raw logprobs at every prompt position and the last one, against HF's log-softmax."""
    path, hf = tiny_models[arch]
    llm = LLM(model=path, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    p = prompts(hf.config.vocab_size, count=1, seed=3)[0] + [7, 8, 9]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, logprobs=5, prompt_logprobs=5))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].log_softmax(-1)
    last = out.outputs[0].logprobs[0]
    for tok, lp in last.items():
        assert lp.logprob == pytest.approx(ref[-1, tok].item(), abs=2e-5)
    assert set(last) >= set(ref[-1].topk(5).indices.tolist())
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        tok = p[pos + 1]
        assert entry[tok].logprob == pytest.approx(ref[pos, tok].item(), abs=2e-5)


def test_rope_scaling_llama3_and_linear_match_hf(tmp_path):
    from tiny_models import build_model

    for kind, scaling in {
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32},
        "linear": {"rope_type": "linear", "factor": 2.0},
    }.items():
        path = str(tmp_path / kind)
        hf = build_model(path, "llama", rope_scaling=scaling)
        llm = LLM(model=path, kv_cache={"plugin": "paged", "num_blocks": 64})
        p = prompts(hf.config.vocab_size, count=1, seed=5)[0] + list(range(10, 60))
        out = llm.generate({"prompt_token_ids": p}, GREEDY)[0]
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 24), kind


def test_chunked_prefill_and_tiny_budget_match_hf(tiny_models):
    path, hf = tiny_models["llama"]
    llm = LLM(model=path, scheduler={"plugin": "fcfs", "max_num_batched_tokens": 7, "max_num_seqs": 3},
              kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    ps = prompts(hf.config.vocab_size, count=5, seed=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)


def test_preemption_under_a_tiny_pool_matches_hf(tiny_models):
    path, hf = tiny_models["llama"]
    llm = LLM({"model": {"path": path, "max_model_len": 160}, "kv_cache": {"plugin": "paged", "block_size": 16, "num_blocks": 12}})
    ps = prompts(hf.config.vocab_size, count=8, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24)
