"""The paged KV backend releasing blocks behind the sliding window (``free_outside_window``).

A tiny Mistral whose every layer has a window of 16, served with 4-token blocks well past the
window: greedy tokens equal HF ``transformers``' (a mixed batch, chunked prefill, prefix hits,
preemption by recompute and by swap, ``n > 1`` forks, n-gram speculation) on the ``torch`` and
``cpu`` attention backends; a request holds ``ceil(x / B) - floor((x - W) / B)`` blocks (``x``:
the tokens its last step covers) instead of ``ceil(x / B)``; a Gemma-style model mixing local
and global layers keeps every block. The conftest guard checks every block is back in the pool.
"""

from __future__ import annotations

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.contract import KVSpec, hookimpl
from modserve.core.plugin_manager import standalone_context
from modserve.core.request import Request
from modserve.plugins.kv_backends.paged import PagedConfig, PagedKVBackend
from tiny_models import build_model, hf_greedy, prompts

WINDOW, BS = 16, 4
BACKENDS = ["torch", "cpu"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """(path, hf) of a Mistral with sliding_window 16 on every layer."""
    path = str(tmp_path_factory.mktemp("mistral_w16"))
    return path, build_model(path, "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def oracle(windowed):
    cache: dict[tuple, list[int]] = {}

    def want(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(windowed[1], prompt, n)
        return cache[key]

    return want


class SpecLog:
    accepted = 0

    @hookimpl
    def on_step_finished(self, stats):
        self.accepted += stats.num_accepted_tokens


def held(kv: PagedKVBackend) -> int:
    return kv.num_blocks - kv.num_free_blocks


def dead(num_computed: int) -> int:
    """Leading blocks no query at a position >= ``num_computed`` sees: block ``b`` is dead
    once ``(b + 1) * B - 1 <= num_computed - W``."""
    return max(0, (num_computed - WINDOW + 1) // BS)


def expected_live(before: int, x: int) -> int:
    """Blocks a request holds after the step that computed positions ``before .. x - 1``:
    all ``ceil(x / B)`` minus the dead ones."""
    return -(-x // BS) - dead(before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixed_batch_past_the_window_matches_hf(windowed, oracle, backend):
    """Prompts of 1-69 tokens and 40 new tokens each (up to 109 = ~7 windows)."""
    path, hf = windowed
    ps = prompts(hf.config.vocab_size, count=8, seed=5)
    llm = LLM(model={"path": path, "max_model_len": 256}, attention={"plugin": backend},
              kv_cache={"plugin": "paged", "block_size": BS, "num_blocks": 256})
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], greedy(40))]
    assert got == [oracle(p, 40) for p in ps]
    assert len({tuple(t) for t in got}) > 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_prefix_hits_and_preemption_match_hf(windowed, oracle, backend, mode):
    """8-token steps (chunks start inside and beyond the window), a shared 48-token prefix
    served again from the cache (its early blocks were released, not wiped), and a pool of
    28 blocks (112 tokens: max_model_len) for 6 requests of up to 109 tokens: preemption."""
    path, hf = windowed
    llm = LLM(model={"path": path, "max_model_len": 112}, attention={"plugin": backend},
              kv_cache={"plugin": "paged", "block_size": BS, "num_blocks": 28, "prefix_caching": True},
              scheduler={"plugin": "fcfs", "max_num_batched_tokens": 8, "max_num_seqs": 6, "preemption_mode": mode})
    shared = list(range(20, 68))
    ps = [shared + [100 + i, 101 + i] for i in range(3)] + prompts(hf.config.vocab_size, count=3, seed=9)
    want = [oracle(p, 40) for p in ps]
    first = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(40))
    hits = llm.engine.scheduler.stats().prefix_hits
    again = llm.generate([{"prompt_token_ids": p} for p in ps[:3]], greedy(40))
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want[:3]
    assert llm.engine.scheduler.stats().prefix_hits - hits >= 48
    assert llm.engine.scheduler.stats().num_preemptions > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_n_greater_than_one_forks_and_ngram_speculation_match_hf(windowed, oracle, backend):
    """Forked siblings share the released table (placeholders included) and copy on write;
    speculation rolls rejected drafts back within the last allocation only."""
    path, hf = windowed
    motif = [7, 91, 33, 150, 12]
    ps = [(motif * 12)[:50], prompts(hf.config.vocab_size, count=1, seed=3)[0]]
    llm = LLM(model={"path": path, "max_model_len": 256}, attention={"plugin": backend},
              kv_cache={"plugin": "paged", "block_size": BS, "num_blocks": 128},
              scheduler={"plugin": "fcfs", "max_num_batched_tokens": 16},  # the prompt's last chunk releases blocks
              speculative={"plugin": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    drafts = SpecLog()
    llm.engine.c.registry.pm.register(drafts)
    out = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(40).with_changes(n=2))
    for p, o in zip(ps, out):
        assert [c.token_ids for c in o.outputs] == [oracle(p, 40)] * 2
    assert drafts.accepted > 0


def test_a_request_holds_window_over_block_size_plus_one_or_two_blocks(windowed):
    """Step one request by hand (16-token chunks, prefix caching off: a released block is idle
    at once): after every step it holds exactly ``expected_live`` blocks; in its last decode
    steps ceil(16 / 4) + 1 = 5 instead of 25, and without freeing all of them."""
    prompt, n = list(range(3, 53)), 50  # 50 + 50 tokens: the last step computes position 98
    for free in (True, False):
        llm = LLM(model={"path": windowed[0], "max_model_len": 256},
                  kv_cache={"plugin": "paged", "block_size": BS, "num_blocks": 64, "prefix_caching": False,
                            "free_outside_window": free},
                  scheduler={"plugin": "fcfs", "max_num_batched_tokens": 16})
        engine, kv = llm.engine, llm.engine.kv
        (req,) = engine.add_request(prompt, greedy(n), request_id="r")
        live = {}
        while engine.has_unfinished():
            before = req.num_computed_tokens
            engine.step()
            x = min(before + 16, req.num_tokens - 1) if before < len(prompt) else before + 1
            if not req.is_finished:
                live[x] = held(kv)
                assert held(kv) == (expected_live(before, x) if free else -(-x // BS)), (before, x)
                assert kv.block_table(req).count(kv.num_blocks) == (dead(before) if free else 0)
        assert x == 99 and held(kv) == 0
        assert live[98] == (5 if free else 25) and live[97] == (5 if free else 25) and live[96] == (4 if free else 24)
        # the peak is a prefill chunk's: its 16 new positions plus the window behind its first query
        assert max(live.values()) == (8 if free else 25)


def test_peak_blocks_are_lower_with_freeing_and_the_tokens_equal(windowed):
    path, hf = windowed
    ps = prompts(hf.config.vocab_size, count=6, seed=11)
    peaks, tokens = {}, {}
    for free in (True, False):
        llm = LLM(model={"path": path, "max_model_len": 256},
                  kv_cache={"plugin": "paged", "block_size": BS, "num_blocks": 256, "prefix_caching": False,
                            "free_outside_window": free},
                  scheduler={"plugin": "fcfs", "max_num_batched_tokens": 32})
        engine = llm.engine
        for i, p in enumerate(ps):
            engine.add_request(p, greedy(60), request_id=str(i))
        peak, outs = 0, {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            peak = max(peak, held(engine.kv))
        peaks[free], tokens[free] = peak, [outs[str(i)] for i in range(len(ps))]
    assert tokens[True] == tokens[False]
    assert peaks[True] < peaks[False] / 2, peaks


def test_a_model_mixing_local_and_global_layers_keeps_every_block(tmp_path):
    """Gemma 2 (window 12 on alternate layers): global layers read every position."""
    path = str(tmp_path / "g2")
    build_model(path, "gemma2")
    llm = LLM(model=path, kv_cache={"plugin": "paged", "block_size": BS, "num_blocks": 128})
    kv = llm.engine.kv
    assert kv.window is None and kv.layer_caches()[0].k.shape[0] == kv.num_blocks
    engine = llm.engine
    (req,) = engine.add_request(list(range(3, 43)), greedy(30), request_id="g")
    while engine.has_unfinished():
        engine.step()
        if not req.is_finished:
            assert kv.num_blocks not in kv.block_table(req)
            assert held(kv) == len(kv.block_table(req))
    with pytest.raises(ValueError, match="free_outside_window: true needs a sliding window on every layer.*mixes"):
        LLM(model=path, kv_cache={"plugin": "paged", "block_size": BS, "num_blocks": 128, "free_outside_window": True})


def _backend(**model) -> PagedKVBackend:
    from modserve.core.contract.model_spec import ModelSpec

    spec = ModelSpec("mistral", 100, 8, 16, 2, 1, 1, 8, 1e-6, 1e4, None, 256, False, False, **model)
    kv_spec = KVSpec(2, 1, 8, torch.float32, torch.device("cpu"), 64)
    return PagedKVBackend(PagedConfig(block_size=BS, num_blocks=32), standalone_context(model=spec, kv_spec=kv_spec))


def test_a_rollback_behind_released_blocks_raises_instead_of_reading_the_placeholder():
    kv = _backend(sliding_window=8)
    req = Request("r", list(range(40)), greedy(1))
    assert kv.allocate(req, 40)
    req.num_computed_tokens = 40
    assert kv.allocate(req, 1)  # queries at >= 40 see positions > 32: blocks 0..7 (0..31) are dead
    assert kv.block_table(req)[:8] == [kv.null_block] * 8 and held(kv) == 11 - 8
    kv.trim(req, 41)  # the engine's rollback of rejected drafts: fine
    with pytest.raises(RuntimeError, match="rolled back to 38 tokens, behind blocks already released"):
        kv.trim(req, 38)
    kv.free(req)
    assert held(kv) == 0
    # a windowed model on only some layers, or a proposer's own KV: nothing released
    assert _backend(sliding_window=8, sliding_window_layers=(0,)).window is None


def test_the_contiguous_baseline_refuses_free_outside_window_by_name():
    from modserve.core.config import ConfigError
    from modserve.core.engine_factory import resolve

    with pytest.raises(ConfigError, match="kv_cache.free_outside_window: the contiguous baseline keeps every reserved slot"):
        resolve({"kv_cache": {"plugin": "contiguous", "free_outside_window": True}})
    resolve({"kv_cache": {"plugin": "contiguous", "free_outside_window": False}})  # saying no is fine
