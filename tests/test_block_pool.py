"""Property tests of the block pool and the paged backend's accounting (hypothesis)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modserve.core.contract import KVSpec
from modserve.core.plugin_manager import standalone_context
from modserve.core.request import Request, RequestStatus
from modserve.core.sampling_params import SamplingParams
from modserve.plugins.kv_backends.block_pool import BlockPool
from modserve.plugins.kv_backends.paged import PagedConfig, PagedKVBackend

ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "touch", "free", "cache"]), st.integers(0, 7), st.integers(1, 4)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_block_pool_never_double_allocates_or_leaks(operations):
    pool = BlockPool(16)
    owners: dict[int, list[int]] = {}  # owner -> blocks it holds a ref on
    for op, owner, n in operations:
        held = owners.setdefault(owner, [])
        if op == "alloc" and n <= pool.num_free:
            got = pool.allocate(n)
            in_use = {b for bl in owners.values() for b in bl}
            assert not in_use & set(got), "a block in use was handed out again"
            assert got == sorted(got), "one allocation's blocks come in ascending order"
            held += got
        elif op == "touch" and owners:
            donor = next((bl for o, bl in owners.items() if o != owner and bl), None)
            if donor:
                pool.touch(donor[:1])
                held.append(donor[0])
        elif op == "free" and held:
            pool.free(held[::-1])
            held.clear()
        elif op == "cache" and held:
            pool.cache(held[0], bytes([owner, n]), (owner, n))
        refs = {}
        for bl in owners.values():
            for b in bl:
                refs[b] = refs.get(b, 0) + 1
        assert all(pool.ref_cnt[b] == c for b, c in refs.items())
        assert pool.num_free == 16 - len(refs)
        assert all((b in pool.free_queue) == (b not in refs) for b in range(16))
    for bl in owners.values():
        pool.free(bl[::-1])
    assert pool.num_free == 16


def _backend(num_blocks=8, block_size=4, prefix_caching=True):
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"), max_model_len=16)
    return PagedKVBackend(PagedConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching), standalone_context(kv_spec=spec))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.booleans()), max_size=40))
def test_paged_backend_grows_frees_and_shares_without_leaks(script):
    """Random requests grow (with prefix lookups on admission), publish, and finish."""
    kv = _backend()
    live: dict[int, Request] = {}
    for rid, grow, finish in script:
        req = live.get(rid)
        if req is None:
            req = Request(str(rid), [rid % 2] * 6, SamplingParams())
            hit = kv.lookup_prefix(req)
            assert hit.num_tokens < req.num_tokens
            if kv.allocate(req, req.num_tokens - hit.num_tokens, hit):
                req.num_computed_tokens = req.num_tokens
                kv.cache_blocks(req, req.num_computed_tokens)
                live[rid] = req
            continue
        if kv.allocate(req, grow):
            req.all_token_ids += [9] * grow
            req.num_computed_tokens += grow
            kv.cache_blocks(req, req.num_computed_tokens)
        assert len(kv.block_table(req)) * kv.block_size >= req.num_computed_tokens
        if finish:
            req.status = RequestStatus.FINISHED
            kv.free(req)
            del live[rid]
        held = [b for r in live.values() for b in kv.block_table(r)]
        assert kv.num_free_blocks == kv.num_blocks - len(set(held))
    for req in live.values():
        kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks


def test_allocations_are_ascending_runs_that_attention_reads_forward():
    """A fresh pool's queue hands out N-1, N-2, ...; a freed request comes back tail-first.
    Either way one allocation (a prompt's blocks) must be an ascending run of neighbours."""
    pool = BlockPool(64)
    first, second = pool.allocate(16), pool.allocate(16)
    assert first == list(range(48, 64)) and second == list(range(32, 48))
    for block, tag in zip(first, range(16)):
        pool.cache(block, bytes([tag]), (tag,))  # a prompt's full blocks, hashed
    pool.free(first[::-1])  # tail-first, as the paged backend frees
    pool.allocate(32)  # the uncached blocks 0..31 go first
    assert pool.allocate(16) == first  # then the cached ones, least recently freed first


def test_prefix_hit_compares_tokens_and_salt():
    kv = _backend()
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    assert kv.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_blocks(a, a.num_tokens)
    same = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 10], SamplingParams())
    assert kv.lookup_prefix(same).num_tokens == 8
    salted = Request("c", [1, 2, 3, 4, 5, 6, 7, 8, 10], SamplingParams(), cache_salt="tenant-2")
    assert kv.lookup_prefix(salted).num_tokens == 0
    exact = Request("d", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams())
    assert kv.lookup_prefix(exact).num_tokens == 4  # the last token is always recomputed
    # a forged collision: same hash, different tokens, is not served
    block = kv.pool.cached[kv._block_hashes(a, 1)[0]]
    kv.pool.block_tokens[block] = (9, 9, 9, 9)
    assert kv.lookup_prefix(same).num_tokens == 0
    kv.free(a)
    assert kv.num_free_blocks == kv.num_blocks
