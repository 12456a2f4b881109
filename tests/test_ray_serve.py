"""modserve on Ray Serve: the routing key, the router, the autoscaling policy and the options
from a pipeline (no cluster); the request bridge and the ingress's failure handling (real
app, fake replicas); then the smoke script: a two-node local cluster, two replicas, one killed
mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
import ray.exceptions
from server_helpers import MODEL_NAME, pipeline
from starlette.applications import Starlette
from starlette.routing import Route

from modserve.cli import main as cli_main
from modserve.core.async_engine import AsyncEngine
from modserve.core.config import ConfigError, load_pipeline
from modserve.core.engine import Engine
from modserve.ray_serve import app as ray_app
from modserve.ray_serve.autoscaling import EngineLoadPolicy
from modserve.ray_serve.forwarding import BODY, START, ForwardedRequest, run_asgi
from modserve.ray_serve.ingress import Ingress
from modserve.ray_serve.router import PrefixAwareRouter
from modserve.ray_serve.routing_key import RoutingKeys, prompt_units
from modserve.server.app import build_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = "You are a careful assistant for the harbor office. " * 8  # > 4 blocks of 64 characters


def chat(system: str, user: str, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **extra}).encode()


# ----------------------------------------------------------------------------- routing key


def test_routing_key_follows_the_shared_leading_text():
    keys = RoutingKeys(block_size=16)  # blocks of 64 characters, at most 4
    path = "/v1/chat/completions"
    a, b = keys.key(path, chat(LONG, "first question")), keys.key(path, chat(LONG, "another one"))
    assert a is not None and a == b  # the leading 256 characters are the shared system prompt
    assert keys.key(path, chat("Other. " + LONG, "first question")) != a
    assert keys.key(path, chat(LONG, "q", cache_salt="tenant-a")) != keys.key(path, chat(LONG, "q", cache_salt="tenant-b"))
    assert keys.key(path, chat("short", "hi")) is None  # under one block: nothing worth keeping together
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert keys.key(path, chat(LONG, "first question", tools=tools)) != a  # tools render before the messages


def test_prompt_units_of_each_route():
    assert prompt_units("/v1/completions", json.dumps({"prompt": "abc"}).encode()) == ("abc", None)
    assert prompt_units("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()) == ([1, 2, 3], None)
    assert prompt_units("/v1/completions", json.dumps({"prompt": ["x", "y"]}).encode()) == ("x", None)
    units, _ = prompt_units("/v1/responses", json.dumps({"instructions": "be brief", "input": "hello"}).encode())
    assert units.endswith("hello") and "be brief" in units
    assert prompt_units("/v1/chat/completions", b"not json") == (None, None)
    assert prompt_units("/v1/models", b"") == (None, None)
    keys = RoutingKeys(block_size=4)
    assert keys.key("/v1/completions", json.dumps({"prompt": list(range(20))}).encode()) == \
        keys.key("/v1/completions", json.dumps({"prompt": list(range(16)) + [0]}).encode())  # tokens: blocks of 4


# ----------------------------------------------------------------------------- router


class _QueueLens(dict):
    def get(self, replica_id, default=None):
        return super().get(replica_id, default)


def _router() -> PrefixAwareRouter:
    r = object.__new__(PrefixAwareRouter)  # Ray builds it inside a handle; only the policy is under test
    r._replica_queue_len_cache = _QueueLens()
    r.initialize_state()
    return r


def _replica(rid: str, active: int) -> SimpleNamespace:
    return SimpleNamespace(replica_id=rid, routing_stats={"active": active})


def _pending(key):
    return SimpleNamespace(kwargs={"routing_key": key})


def test_router_keeps_a_prefix_on_its_replica_until_it_is_much_busier():
    router = _router()
    a, b, c = _replica("a", 3), _replica("b", 0), _replica("c", 1)
    ranked = asyncio.run(router.choose_replicas([a, b, c], _pending(42)))
    assert [[r.replica_id for r in group] for group in ranked] == [["b"], ["c", "a"]]  # new key: least loaded first
    router.on_request_routed(_pending(42), "b", None)
    b.routing_stats["active"] = 5  # busier than c (1), but 5 <= 2 * 1 + 4: stays where the prefix is
    assert asyncio.run(router.choose_replicas([a, b, c], _pending(42)))[0][0].replica_id == "b"
    b.routing_stats["active"] = 7  # 7 > 2 * 1 + 4: moves to the least loaded
    assert asyncio.run(router.choose_replicas([a, b, c], _pending(42)))[0][0].replica_id == "c"
    router._replica_queue_len_cache["c"] = 9  # what this router sent counts too (fresher than the engine's report)
    assert asyncio.run(router.choose_replicas([a, b, c], _pending(None)))[0][0].replica_id == "a"
    assert asyncio.run(router.choose_replicas([b, c], _pending(42)))[0][0].replica_id in ("b", "c")  # a died: fine
    assert asyncio.run(router.choose_replicas([], _pending(42))) == []


# ----------------------------------------------------------------------------- autoscaling and options


def test_autoscaling_policy_reads_engine_counters():
    policy = EngineLoadPolicy(target_active_per_replica=8, kv_usage_high=0.9)
    assert policy.wanted(total_active=20, max_kv_usage=0.1, current=1) == 3  # ceil(20 / 8)
    assert policy.wanted(total_active=0, max_kv_usage=0.0, current=2) == 1  # never below one
    assert policy.wanted(total_active=4, max_kv_usage=0.95, current=2) == 3  # a full cache asks for one more
    ctx = SimpleNamespace(aggregated_metrics={"active": {"r1": 12.0, "r2": 6.0}, "kv_usage": {"r1": 0.2}},
                          current_num_replicas=2, target_num_replicas=2)
    assert policy(ctx) == (3, {})
    starting = SimpleNamespace(aggregated_metrics={}, current_num_replicas=0, target_num_replicas=2)
    assert policy(starting) == (2, {})


def test_engine_options_from_the_ray_section():
    fixed = ray_app.engine_options(load_pipeline({"ray": {"num_replicas": 3, "num_cpus_per_replica": 2}}))
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"]["num_cpus"] == 2
    assert fixed["request_router_config"].request_router_class is not None
    scaled = ray_app.engine_options(load_pipeline({
        "ray": {"autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_active_per_replica": 6}, "router": "power_of_two"},
    }))
    a = scaled["autoscaling_config"]
    assert (a["min_replicas"], a["max_replicas"]) == (1, 4) and "num_replicas" not in scaled
    assert a["policy"]["policy_kwargs"]["target_active_per_replica"] == 6
    assert "request_router_config" not in scaled  # Ray Serve's own power-of-two router
    tp = ray_app.engine_options(load_pipeline({"parallel": {"tensor_parallel_size": 2}, "ray": {}}))
    assert tp["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}] and tp["placement_group_strategy"] == "STRICT_PACK"


@pytest.mark.parametrize("ray_section, message", [
    ({"num_replicas": 2, "autoscaling": {}}, "ray.num_replicas: give either num_replicas or autoscaling, not both"),
    ({"autoscaling": {"min_replicas": 3}}, "ray.autoscaling.max_replicas: 2 is below min_replicas 3"),
    ({"router": "random"}, "ray.router: expected one of prefix, power_of_two, got 'random'"),
    ({"num_cpus_per_replica": 0}, "ray.num_cpus_per_replica: expected float > 0.0, got 0"),
    ({"replicas": 2}, "ray.replicas: unknown key"),
])
def test_bad_ray_sections_name_the_key(ray_section, message):
    with pytest.raises(ConfigError) as err:
        load_pipeline({"ray": ray_section})
    assert str(err.value) == message


def test_plain_serve_says_the_ray_section_is_not_its_own(tmp_path):
    from modserve.bench.launch import launch_server

    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps({**pipeline(), "ray": {"num_replicas": 2}}))  # JSON is YAML
    proc, url, _ = launch_server(["modserve.cli", "serve", "-c", str(config), "--port", "0"], tmp_path / "serve.log")
    try:
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    assert "the pipeline's ray: section applies to `modserve ray serve`" in (tmp_path / "serve.log").read_text()


def test_data_parallel_size_is_refused_on_ray():
    with pytest.raises(ConfigError, match="parallel.data_parallel_size"):
        ray_app.build_application(pipeline(parallel={"data_parallel_size": 2}))


def test_without_ray_the_cli_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(ray_app, "ray", None)
    assert cli_main(["ray", "serve"]) == 2
    assert "pip install 'modserve[ray]'" in capsys.readouterr().err


def test_an_unreachable_cluster_is_named_at_once(capsys):
    assert cli_main(["ray", "serve", "--address", "127.0.0.1:1"]) == 2
    assert "--address: no Ray cluster at '127.0.0.1:1'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the request bridge (real app)


def _post(path: str, body: dict) -> ForwardedRequest:
    return ForwardedRequest("POST", path, b"", [(b"content-type", b"application/json")], json.dumps(body).encode())


def test_bridge_runs_the_servers_own_app():
    engine = AsyncEngine(Engine.from_config(load_pipeline(pipeline())))
    app = build_app(engine)

    async def go():
        engine.start()
        whole = [p async for p in run_asgi(app, _post("/v1/completions", {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 4}))]
        streamed = [p async for p in run_asgi(app, _post("/v1/completions", {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 4, "stream": True}))]
        missing = [p async for p in run_asgi(app, _post("/v1/completions", {"model": "nope", "prompt": "x"}))]
        # a client gone mid-stream: closing the bridge aborts the generation
        gen = run_asgi(app, _post("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True}))
        assert (await anext(gen))[0] == START
        assert (await anext(gen))[0] == BODY
        await gen.aclose()
        for _ in range(100):  # the abort reaches the engine loop
            if not engine.engine.requests:
                break
            await asyncio.sleep(0.05)
        left = len(engine.engine.requests)
        metrics = b"".join(p[1] for p in [x async for x in run_asgi(app, ForwardedRequest("GET", "/metrics"))][1:])
        await engine.stop()
        return whole, streamed, missing, left, metrics.decode()

    whole, streamed, missing, left, metrics = asyncio.run(go())
    assert whole[0][:2] == (START, 200) and json.loads(whole[1][1])["usage"]["completion_tokens"] == 4
    assert streamed[0][1] == 200 and b"".join(p[1] for p in streamed[1:]).endswith(b"data: [DONE]\n\n")
    assert missing[0][1] == 404 and json.loads(missing[1][1])["error"]["code"] == "model_not_found"
    assert left == 0
    aborted = [ln for ln in metrics.splitlines() if ln.startswith("modserve:request_success_total") and 'reason="abort"' in ln]
    assert aborted and aborted[0].endswith(" 1.0")  # the 400-token stream was aborted, not finished


# ----------------------------------------------------------------------------- the ingress (fake replicas)


class _FakeStream:
    """A replica's streamed answer: ``pieces``, failing with ``fail`` after ``fail_after`` of them."""

    def __init__(self, pieces, fail_after=None) -> None:
        self.pieces, self.fail_after, self.i = list(pieces), fail_after, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail_after is not None and self.i >= self.fail_after:
            raise ray.exceptions.ActorDiedError()
        if self.i >= len(self.pieces):
            raise StopAsyncIteration
        self.i += 1
        return self.pieces[self.i - 1]

    def cancel(self) -> None:
        pass


class _FakeHandle:
    def __init__(self, attempts) -> None:
        self.attempts = list(attempts)
        self.calls = []
        self.handle = self

    def options(self, **_):
        return self

    def remote(self, request, routing_key=None):
        self.calls.append(routing_key)
        return self.attempts.pop(0)


SSE = (START, 200, [(b"content-type", b"text/event-stream")])


def _ingress_client(handle) -> httpx.AsyncClient:
    ingress = Ingress(handle, block_size=16, max_retries=1)

    async def endpoint(request):
        return await ingress(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST"])])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress")


def _ask(handle, path="/v1/chat/completions", body=None):
    async def go():
        async with _ingress_client(handle) as client:
            return await client.post(path, content=body or chat(LONG, "q"))

    return asyncio.run(go())


def test_ingress_retries_a_replica_lost_before_answering():
    ok = _FakeStream([(START, 200, [(b"content-type", b"application/json")]), (BODY, b'{"ok": true}')])
    handle = _FakeHandle([_FakeStream([], fail_after=0), ok])
    r = _ask(handle)
    assert r.status_code == 200 and r.json() == {"ok": True} and r.headers["x-modserve-retries"] == "1"
    assert handle.calls[0] is not None and handle.calls[0] == handle.calls[1]  # the same prefix key both times


def test_ingress_gives_a_clean_503_when_every_attempt_fails():
    r = _ask(_FakeHandle([_FakeStream([], fail_after=0), _FakeStream([SSE], fail_after=1)]))
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    assert "ray.max_retries is 1" in r.json()["error"]["message"]


def test_ingress_ends_a_broken_stream_with_an_error_event():
    chunk = (BODY, b'data: {"choices": []}\n\n')
    r = _ask(_FakeHandle([_FakeStream([SSE, chunk, chunk], fail_after=3)]))
    events = [e for e in r.text.split("\n\n") if e]
    assert events[:2] == ['data: {"choices": []}'] * 2
    assert json.loads(events[2][6:])["error"]["code"] == "replica_failed" and events[3] == "data: [DONE]"
    r = _ask(_FakeHandle([_FakeStream([SSE, chunk], fail_after=2)]), "/v1/responses", b'{"input": "hi"}')
    last = r.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ") and json.loads(last.split("data: ", 1)[1])["sequence_number"] == 1


# ----------------------------------------------------------------------------- live: a local cluster


@pytest.fixture(scope="module")
def local_cluster():
    """A fresh one-node Ray cluster of 2 CPUs (never one already running here) with Serve's
    proxy on a free port; yields the base URL."""
    from ray import serve

    # replicas push autoscaling metrics every 10 s by default; the spawned processes inherit this
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port for Ray Serve's proxy (it takes no port 0)
    port = sock.getsockname()[1]
    sock.close()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_tensor_parallel_replica_runs_in_its_placement_group_and_matches_one_process(local_cluster):
    """A replica with tensor_parallel_size 2 (two bundles of one CPU, packed) answers exactly
    what a single-process engine answers."""
    from ray import serve

    from modserve import LLM, SamplingParams

    prompt = "the quick brown fox"
    expected = LLM(pipeline()).generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    cfg = pipeline(parallel={"tensor_parallel_size": 2})
    app, _ = ray_app.build_application({**cfg, "ray": {"num_replicas": 1, "num_cpus_per_replica": 1, "app_name": "tp"}})
    serve.run(app, name="tp", route_prefix="/")
    try:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{local_cluster}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected.outputs[0].text
        groups = [pg for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
        assert any(pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 2 for pg in groups)
    finally:
        serve.delete("tp")


def test_autoscaling_adds_a_replica_under_load_within_bounds(local_cluster):
    """min 1, max 2, 2 active requests per replica wanted: 8 clients asking back to back bring
    the second replica (the engines' own counters drive it), and never a third."""
    from ray import serve

    cfg = pipeline()
    app, _ = ray_app.build_application({**cfg, "ray": {"app_name": "scale", "num_cpus_per_replica": 1, "autoscaling": {
        "min_replicas": 1, "max_replicas": 2, "target_active_per_replica": 2, "look_back_s": 1.0,
        "upscale_delay_s": 0.5, "downscale_delay_s": 600}}})
    serve.run(app, name="scale", route_prefix="/")

    def running() -> int:
        return serve.status().applications["scale"].deployments["engine"].replica_states.get("RUNNING", 0)

    try:
        assert running() == 1
        body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 480, "ignore_eos": True}

        async def load_until_scaled():
            """8 clients asking back to back until the second replica runs (60 s at most)."""
            scaled = asyncio.Event()
            codes: list[int] = []

            async def client_loop(client):
                while not scaled.is_set():
                    codes.append((await client.post(f"{local_cluster}/v1/completions", json=body)).status_code)

            async with httpx.AsyncClient(timeout=120) as client:
                loops = [asyncio.ensure_future(client_loop(client)) for _ in range(8)]
                most = 1
                for _ in range(120):
                    most = max(most, await asyncio.to_thread(running))
                    if most >= 2:
                        break
                    await asyncio.sleep(0.5)
                scaled.set()
                await asyncio.gather(*loops)
            return most, codes

        most, codes = asyncio.run(load_until_scaled())
        assert codes and set(codes) == {200}
        assert most == 2
        assert running() <= 2
    finally:
        serve.delete("scale")


# ----------------------------------------------------------------------------- the smoke script: a real cluster


def test_smoke_script_kills_a_replica_mid_run_and_keeps_serving():
    script = os.path.join(ROOT, "examples", "deploy", "ray", "smoke.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", script, "--requests", "18", "--concurrency", "6", "--max-tokens", "24",
                           "--kill-after", "4"], capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    during = report["during"]
    assert during["requests"] == 16  # 4 prefix groups of 4
    assert during["broken"] == 0 and during["ok"] + during["error"] == during["requests"]
    assert during["error"] <= 6  # at most what the killed replica held (6 clients)
    assert report["killed"]["pid"] and report["recovered_in_s"] is not None
    assert report["after"]["ok"] == report["after"]["requests"]
