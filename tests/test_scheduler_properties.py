"""Hypothesis property tests of the schedulers over a real paged KV backend (no model).

The simulation plays the engine's part: scheduled tokens become computed, a request that
catches up gets one new token, and finishes after its own output length.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modserve.core.contract import KVSpec
from modserve.core.plugin_manager import standalone_context
from modserve.core.request import Request, RequestStatus
from modserve.core.sampling_params import SamplingParams
from modserve.plugins.kv_backends.paged import PagedConfig, PagedKVBackend
from modserve.plugins.schedulers.fcfs import FCFSScheduler
from modserve.plugins.schedulers.priority import PriorityConfig, PriorityScheduler
from modserve.core.scheduler_base import SchedulerConfig

MAX_LEN = 64

requests_st = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 6)),  # prompt, output, priority, arrival step
    min_size=1,
    max_size=12,
)


def make(kind, seqs, budget, blocks, mode, prefix):
    spec = KVSpec(1, 1, 2, torch.float32, torch.device("cpu"), MAX_LEN)
    kv = PagedKVBackend(PagedConfig(block_size=4, num_blocks=blocks, prefix_caching=prefix, swap_space_gb=1e-4), standalone_context(kv_spec=spec))
    cfg_cls, cls = (PriorityConfig, PriorityScheduler) if kind == "priority" else (SchedulerConfig, FCFSScheduler)
    return kv, cls(cfg_cls(max_num_seqs=seqs, max_num_batched_tokens=budget, preemption_mode=mode), standalone_context(kv_spec=spec, kv=kv))


@settings(max_examples=120, deadline=None)
@given(
    requests_st,
    st.sampled_from(["fcfs", "priority"]),
    st.integers(1, 4),
    st.integers(1, 48),
    st.integers(16, 40),
    st.sampled_from(["recompute", "swap"]),
    st.booleans(),
)
def test_scheduler_invariants(specs, kind, seqs, budget, blocks, mode, prefix):
    kv, sched = make(kind, seqs, budget, blocks, mode, prefix)
    pending = [
        (arrival, Request(f"r{i}", [1 + i % 3] * p, SamplingParams(max_tokens=o), priority=pr))
        for i, (p, o, pr, arrival) in enumerate(specs)
    ]
    admitted_order: list[str] = []
    done: set[str] = set()
    for step in range(600):
        for arrival, req in [x for x in pending if x[0] <= step]:
            sched.add_request(req)
            pending.remove((arrival, req))
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert sched.stats().num_running <= seqs
        written: set[int] = set()
        for s in out.scheduled:
            req = s.request
            assert s.num_tokens >= 1
            table = kv.block_table(req)
            first, last = req.num_computed_tokens // 4, (req.num_computed_tokens + s.num_tokens - 1) // 4
            assert last < len(table), "scheduled without blocks"
            for b in table[first : last + 1]:
                assert kv.pool.ref_cnt[b] == 1, "a block being written is shared"
                assert b not in written, "two writers on one block"
                written.add(b)
            if req.request_id not in admitted_order:
                admitted_order.append(req.request_id)
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_tokens
            kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token(7)
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    req.status = RequestStatus.FINISHED
                    finished.append(req)
        sched.finish_requests(finished)
        done |= {r.request_id for r in finished}
        if not pending and not sched.has_unfinished():
            break
    assert done == {f"r{i}" for i in range(len(specs))}, "every admitted request finishes"
    assert kv.num_free_blocks == kv.num_blocks
    if kind == "fcfs" and mode == "recompute":
        # FCFS: among requests that arrived at the same step, admission follows arrival order
        arrivals = {f"r{i}": a for i, (_, _, _, a) in enumerate(specs)}
        firsts = [r for r in admitted_order]
        for a in set(arrivals.values()):
            same = [r for r in firsts if arrivals[r] == a]
            assert same == sorted(same, key=lambda r: int(r[1:]))
