"""Operations: SIGTERM drain, engine-loop death, start-up failures."""

from __future__ import annotations

import asyncio
import gc
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml
from server_helpers import MODEL_NAME, LiveServer, pipeline, server_process

from modserve.server.app import serve
from modserve.server.lifecycle import Runner, bind


def test_sigterm_drains_then_exits_zero(tmp_path):
    # "long" needs 30,000 decode steps: over a minute even at thousands of steps a second, so
    # it cannot finish inside the 5 s grace however fast the machine is (1,900 once did)
    proc, url = server_process(
        tmp_path, max_position_embeddings=32768, kv_cache={"num_blocks": 2048}, server={"shutdown_grace_s": 5.0}
    )
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    results: dict[str, object] = {}
    started = {"short": threading.Event(), "long": threading.Event()}

    def run(name: str, max_tokens: int) -> None:
        text, usage = "", None
        try:
            for chunk in client.completions.create(
                model=MODEL_NAME, prompt="Hello", max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            ):
                started[name].set()
                text += chunk.choices[0].text if chunk.choices else ""
                usage = chunk.usage or usage
            results[name] = usage
        except openai.APIError as e:
            results[name] = e
        finally:
            started[name].set()

    try:
        threads = {"long": threading.Thread(target=run, args=("long", 30000)),
                   "short": threading.Thread(target=run, args=("short", 60))}
        for name in ("long", "short"):
            threads[name].start()
            assert started[name].wait(30)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while httpx.get(f"{url}/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "shutting_down"
        for t in threads.values():
            t.join(30)
        assert results["short"].completion_tokens == 60  # in flight, finished within the grace period
        assert isinstance(results["long"], openai.APIError) and "shutting down" in str(results["long"])
        assert proc.wait(20) == 0
    finally:
        proc.kill()


def test_engine_death_fails_requests_and_exits_nonzero():
    s = LiveServer()
    with s:
        stream = s.client().completions.create(
            model=MODEL_NAME, prompt="Hello", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))

        def broken_step():
            raise RuntimeError("injected failure")

        s.engine.engine.step = broken_step  # the loop thread's next step raises
        with pytest.raises(openai.APIError, match="engine loop died: RuntimeError: injected failure"):
            for _ in stream:
                pass
        assert s.wait_exit(10) == 1

    async def health() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=s.app), base_url="http://app") as c:
            return await c.get("/health")

    r = asyncio.run(health())
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    s.engine.engine.abort_request(list(s.engine.engine.requests))  # the loop thread is gone: clean up here


def _busy_port() -> tuple[object, int]:
    sock = bind("127.0.0.1", 0)
    sock.listen()
    return sock, sock.getsockname()[1]


@pytest.mark.parametrize(
    "case,source,code,words",
    [
        ("missing pipeline file", "/nonexistent/pipeline.yaml", 2, ["pipeline file not found"]),
        ("bad server key", {"server": {"port": "x"}}, 2, ["server.port", "expected int"]),
        ("missing model", {"model": {"path": "/nonexistent/model"}}, 1, ["model not found"]),
        ("otlp exporter not installed", {"observers": [{"plugin": "tracing", "exporter": "otlp"}]}, 2, ["opentelemetry-exporter-otlp"]),
        ("port in use", None, 1, ["in use"]),
    ],
)
def test_startup_failure_is_one_line(capsys, case, source, code, words):
    sock = None
    if source is None:
        sock, port = _busy_port()
        source = {"server": {"port": port}}
    if isinstance(source, dict):
        source = {**pipeline(), **source}
    capsys.readouterr()  # building the tiny model may have printed progress
    try:
        assert serve(source) == code
    finally:
        if sock is not None:
            sock.close()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("modserve serve: error: ")
    assert all(w in err for w in words), err


@pytest.mark.parametrize(
    "entry,port_flag",
    [(["modserve.server"], False), (["modserve.cli", "serve"], True)],
    ids=["python -m modserve.server", "modserve serve --port"],
)
def test_process_exit_status_on_startup_failure(tmp_path, entry, port_flag):
    """The pipeline is validated before anything binds: a bad one exits 2 naming the field
    even when its port is held by another server (here, this test)."""
    sock, port = _busy_port()
    try:
        server = {"host": "127.0.0.1"} if port_flag else {"host": "127.0.0.1", "port": port}
        bad = tmp_path / "pipeline.yaml"
        bad.write_text(yaml.safe_dump({"scheduler": {"plugin": "nope"}, "server": server}))
        argv = [sys.executable, "-m", *entry, "-c", str(bad), *(["--port", str(port)] if port_flag else [])]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        sock.close()
    err = done.stderr.strip()
    assert done.returncode == 2, err
    assert err.startswith("modserve serve: error: scheduler.plugin: unknown") and len(err.splitlines()) == 1, err


def test_serving_runs_with_the_startup_heap_frozen(monkeypatch, capsys):
    """The objects alive after start-up are frozen while the server runs (a full collection
    over them stalls every stream) and unfrozen when it stops."""
    seen = {}

    def run(self):
        seen["frozen"] = gc.get_freeze_count()
        return 0

    monkeypatch.setattr(Runner, "run", run)
    assert serve({**pipeline(), "server": {"port": 0}}) == 0
    assert seen["frozen"] > 10_000  # the model, tokenizer and imports at least
    assert gc.get_freeze_count() == 0
