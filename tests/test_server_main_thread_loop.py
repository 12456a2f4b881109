"""``Runner(main_loop=...)``: the engine loop on the caller's thread, uvicorn beside it.

``serve`` runs it this way so the model's torch ops stay on the thread that loaded the
model (one OpenMP pool; see ``AsyncEngine.run_loop``). pytest runs tests on the main
thread, so these call ``run`` from there, as ``serve`` does.
"""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager

import openai
from server_helpers import MODEL_NAME, pipeline, wait_ready
from starlette.applications import Starlette

from modserve.core.async_engine import AsyncEngine
from modserve.core.engine import Engine
from modserve.core.contract import hookimpl
from modserve.server.app import build_app
from modserve.server.lifecycle import Runner, bind


class StepThreads:
    """Records which thread ran each engine step."""

    def __init__(self) -> None:
        self.threads: set[threading.Thread] = set()

    @hookimpl
    def on_step_finished(self, stats) -> None:
        self.threads.add(threading.current_thread())


def test_engine_steps_run_on_the_calling_thread_and_drain_on_shutdown():
    engine = AsyncEngine(Engine.from_config(pipeline()))
    steps = StepThreads()
    engine.engine.c.registry.pm.register(steps)
    runner = Runner(build_app(engine), engine, bind("127.0.0.1", 0), 5.0, main_loop=engine)
    url = f"http://127.0.0.1:{runner.port}"
    got: dict[str, object] = {}

    def client() -> None:
        try:
            wait_ready(url)
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            got["completion"] = c.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
        except Exception as e:  # reported by the assertions below
            got["error"] = e
        finally:
            runner.shutdown()

    threading.Thread(target=client, daemon=True).start()
    assert runner.run() == 0
    assert "error" not in got, got
    assert got["completion"].usage.completion_tokens == 5
    assert steps.threads == {threading.main_thread()}
    kv = engine.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_an_app_that_fails_to_start_frees_the_calling_thread():
    @asynccontextmanager
    async def lifespan(app):
        raise RuntimeError("startup failed on purpose")
        yield  # pragma: no cover

    engine = AsyncEngine(Engine.from_config(pipeline()))
    runner = Runner(Starlette(lifespan=lifespan), engine, bind("127.0.0.1", 0), 5.0, main_loop=engine)
    rescue = threading.Timer(30, engine.stop_loop)  # only so a regression fails instead of hanging
    rescue.start()
    t = time.monotonic()
    try:
        code = runner.run()
    finally:
        rescue.cancel()
    assert code != 0
    assert time.monotonic() - t < 20
