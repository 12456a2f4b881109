"""AsyncEngine without HTTP: n > 1 merge, abort freeing blocks, the bounded waiting queue."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_helpers import pipeline

from modserve import LLM, SamplingParams
from modserve.core.async_engine import AsyncEngine, ServerBusyError
from modserve.core.engine import Engine


async def _run(engine: AsyncEngine, body):
    engine.start()
    try:
        return await body(engine)
    finally:
        await engine.stop()


def test_n_children_merge_like_offline():
    params = SamplingParams(n=3, seed=5, max_tokens=10, temperature=1.0)
    want = LLM(pipeline()).generate({"prompt_token_ids": [5, 6, 7]}, params)[0]

    async def body(engine: AsyncEngine):
        texts, finished = {}, []
        async for out in engine.generate([5, 6, 7], params, "r1"):
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text_delta
            finished.append(out.finished)
        return texts, finished

    texts, finished = asyncio.run(_run(AsyncEngine(Engine.from_config(pipeline())), body))
    assert texts == {c.index: c.text for c in want.outputs}
    assert finished[-1] and not any(finished[:-1])


def test_abort_frees_blocks_and_capacity_is_bounded():
    engine = Engine.from_config(pipeline(scheduler={"max_num_seqs": 1}))

    async def body(ae: AsyncEngine):
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        stream = ae.generate(list(range(5, 60)), long, "running")
        await anext(stream)
        queued = ae.generate([5, 6], long, "waiting")  # max_num_seqs 1: it waits
        with pytest.raises(ServerBusyError, match="max_waiting_requests is 1"):
            ae.generate([5, 6], long, "refused")
        stream.abort()
        queued.abort()
        deadline = time.monotonic() + 5
        while engine.requests or engine.kv.num_free_blocks != engine.kv.num_blocks:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return ae.num_active

    assert asyncio.run(_run(AsyncEngine(engine, max_waiting_requests=1), body)) == 0


def test_engine_thread_uses_the_process_torch_thread_count(monkeypatch):
    """torch's OpenMP team in a new thread is not sized by the main thread's setting; the
    loop thread must set it, or every op runs on one core (half speed on this machine)."""
    import threading

    import torch

    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append((threading.current_thread().name, n)), real(n)))
    engine = Engine.from_config(pipeline())

    async def body(ae: AsyncEngine):
        async for _ in ae.generate([5, 6, 7], SamplingParams(max_tokens=2), "r"):
            pass

    asyncio.run(_run(AsyncEngine(engine), body))
    assert ("modserve-engine", torch.get_num_threads()) in calls


@pytest.mark.parametrize("window_ms,first_step", [(100, 4), (0, 1)])
def test_an_idle_engine_takes_a_burst_in_one_first_step(window_ms, first_step):
    """Requests arriving 20 ms apart: inside a 100 ms burst window the first step has all four;
    with the window off it starts on the first alone."""
    engine = Engine.from_config(pipeline(server={"burst_window_ms": window_ms}))
    in_step, step = [], engine.step
    engine.step = lambda: (in_step.append(len(engine.requests)), step())[1]  # type: ignore[method-assign]

    async def body(ae: AsyncEngine):
        streams = []
        for i in range(4):
            streams.append(ae.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), f"r{i}"))
            await asyncio.sleep(0.02)
        for s in streams:
            async for _ in s:
                pass

    asyncio.run(_run(AsyncEngine(engine), body))
    assert in_step[0] == first_step
