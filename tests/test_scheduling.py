"""Scheduling and KV sharing on a tiny model: every variant produces the same greedy tokens."""

from __future__ import annotations

import random

import pytest

from modserve import LLM, SamplingParams
from modserve.core.contract import hookimpl

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts(count=8, seed=0, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


def run(path, ps, params=GREEDY, **overrides):
    llm = LLM({"model": {"path": path, "max_model_len": 256}, **overrides})
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)], llm


class StepLog:
    def __init__(self):
        self.steps = []

    @hookimpl
    def on_step_finished(self, stats):
        self.steps.append(stats)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    ps = prompts()
    return ps, run(tiny_llama[0], ps, kv_cache={"plugin": "paged", "num_blocks": 256, "prefix_caching": False})[0]


VARIANTS = {
    "prefix_caching": {"kv_cache": {"plugin": "paged", "num_blocks": 256}},
    "no_chunked_prefill": {"scheduler": {"plugin": "fcfs", "enable_chunked_prefill": False, "max_num_batched_tokens": 64}},
    "tiny_budget_chunks": {"scheduler": {"plugin": "fcfs", "max_num_batched_tokens": 5, "long_prefill_token_threshold": 3}},
    "preempt_recompute": {"kv_cache": {"plugin": "paged", "num_blocks": 17}},
    "preempt_swap": {"kv_cache": {"plugin": "paged", "num_blocks": 17},
                     "scheduler": {"plugin": "fcfs", "preemption_mode": "swap"}},
    "priority": {"scheduler": {"plugin": "priority", "max_num_seqs": 3}},
    "static": {"scheduler": {"plugin": "static", "max_num_seqs": 3}},
    "contiguous": {"kv_cache": {"plugin": "contiguous", "num_blocks": 64}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_identical_across_scheduling_variants(tiny_llama, reference, variant):
    ps, ref = reference
    got, llm = run(tiny_llama[0], ps, **VARIANTS[variant])
    assert got == ref
    if variant.startswith("preempt"):
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_hits_compute_fewer_prompt_tokens_and_salts_isolate(tiny_llama):
    llm = LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 256, "block_size": 16})
    log = StepLog()
    llm.engine.c.registry.pm.register(log)
    ps = prompts(count=4, seed=3, shared=100)
    llm.generate({"prompt_token_ids": ps[0]}, GREEDY)
    computed_first = sum(s.num_prompt_tokens for s in log.steps)
    assert computed_first == len(ps[0])
    log.steps.clear()
    hits_before = llm.engine.scheduler.stats().prefix_hits
    llm.generate([{"prompt_token_ids": p} for p in ps[1:]], GREEDY)
    assert llm.engine.scheduler.stats().prefix_hits - hits_before >= 3 * 96  # six full 16-token blocks each
    assert sum(s.num_prompt_tokens for s in log.steps) <= sum(len(p) for p in ps[1:]) - 3 * 96
    hits_before = llm.engine.scheduler.stats().prefix_hits
    for salt in ("tenant-a", "tenant-b"):
        llm.engine.add_request(ps[1], GREEDY, request_id=salt, cache_salt=salt)
        while llm.engine.has_unfinished():
            llm.engine.step()
    assert llm.engine.scheduler.stats().prefix_hits == hits_before  # neither salt sees the unsalted or the other's blocks


def test_n_greater_than_one_forks_after_one_prompt_with_copy_on_write(tiny_llama):
    llm = LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 64, "block_size": 16, "prefix_caching": False})
    log = StepLog()
    llm.engine.c.registry.pm.register(log)
    prompt = [(7 * i) % 300 + 3 for i in range(37)]  # 37 tokens: the last of 3 blocks is partial, so shared then copied
    single = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    log.steps.clear()
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY.with_changes(n=3))[0]
    assert [o.token_ids for o in out.outputs] == [single] * 3
    assert sum(s.num_prompt_tokens for s in log.steps) == len(prompt)  # computed once, shared by the 3
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    sampled = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    # each child equals the same seed run alone with private KV: shared blocks were copied before writes
    alone = llm.generate([{"prompt_token_ids": prompt}] * 3, [params.with_changes(n=1, seed=1 + i) for i in range(3)])
    assert [o.token_ids for o in sampled.outputs] == [a.outputs[0].token_ids for a in alone]


def test_aborts_free_everything(tiny_llama):
    llm = LLM(model=tiny_llama[0], kv_cache={"plugin": "paged", "num_blocks": 64})
    engine = llm.engine
    engine.add_request(prompts(1, 9)[0], GREEDY.with_changes(n=3), request_id="fam")
    engine.add_request(prompts(1, 10)[0], GREEDY, request_id="solo")
    engine.step()
    engine.abort_request(["fam#0"])  # the leader, with siblings not yet forked if its prompt was chunked
    engine.abort_request(["fam#1", "fam#2"])
    for _ in range(3):
        engine.step()
    outs = engine.abort_request(["solo"])
    assert outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished()


def test_high_priority_gets_its_first_token_before_queued_low_priority(tiny_llama):
    llm = LLM(model=tiny_llama[0], scheduler={"plugin": "priority", "max_num_seqs": 2},
              kv_cache={"plugin": "paged", "num_blocks": 128})
    engine = llm.engine
    first_token_step = {}
    for i in range(6):
        engine.add_request(prompts(1, 20 + i)[0], GREEDY, request_id=f"low{i}", priority=5)
    for _ in range(3):
        engine.step()
    engine.add_request(prompts(1, 40)[0], GREEDY, request_id="urgent", priority=0)
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
    queued = [f"low{i}" for i in range(2, 6)]
    assert all(first_token_step["urgent"] < first_token_step[q] for q in queued)
    assert engine.scheduler.num_preemptions >= 1  # it took a running request's seat
