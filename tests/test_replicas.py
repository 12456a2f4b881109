"""Data-parallel replicas: the router alone, then two tiny-model replicas behind one live server."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from server_helpers import MODEL_NAME, ThreadedServer, parse_metrics, pipeline

from modserve import LLM, SamplingParams
from modserve.bench.launch import launch_server
from modserve.core.config import load_pipeline
from modserve.server.app import build_app, build_replicas
from modserve.server.router import Replicas, Router

BLOCK = 16  # the test pipeline's kv_cache.block_size

# ----------------------------------------------------------------------------- router unit tests


def test_router_sticks_to_the_replica_that_served_the_prefix():
    r = Router(2, BLOCK)
    prefix = list(range(100, 100 + 4 * BLOCK))
    first = r.pick(prefix + [1, 2, 3], None, [0, 0])
    # the other replica is now idler, but not by enough to leave the warm one
    assert r.pick(prefix + [7, 8], None, [3, 0] if first == 0 else [0, 3]) == first
    # only the leading max_blocks blocks count: a longer prompt sharing them sticks too
    assert r.pick(prefix + list(range(500, 600)), None, [0, 0]) == first


def test_router_key_uses_full_blocks_and_salt():
    r = Router(2, BLOCK, max_blocks=4)
    assert r.key(list(range(BLOCK - 1))) is None  # no full block: nothing to share
    assert r.key(list(range(BLOCK))) == r.key(list(range(BLOCK)) + [999])  # the partial block is ignored
    assert r.key(list(range(5 * BLOCK))) == r.key(list(range(4 * BLOCK)) + [0] * BLOCK)  # at most 4 blocks
    assert r.key(list(range(BLOCK)), "a") != r.key(list(range(BLOCK)), "b")  # salts never share a cache


def test_router_least_loaded_for_new_prefixes_and_overloaded_sticky():
    r = Router(3, BLOCK)
    assert r.pick(list(range(BLOCK)), None, [5, 1, 3]) == 1  # new key: least loaded, remembered
    assert r.pick(list(range(BLOCK)), None, [5, 5, 3]) == 1  # 5 <= 2 * 3 + 4: stays warm
    assert r.pick(list(range(BLOCK)), None, [5, 11, 3]) == 2  # 11 > 2 * 3 + 4: moves to the least loaded
    assert r.pick(list(range(BLOCK)), None, [5, 0, 3]) == 2  # ... and is remembered there
    assert r.pick(list(range(BLOCK)), None, [0, 0, 0], eligible=[True, True, False]) in (0, 1)  # draining: skip
    # short prompts carry no key: they go least-loaded, ties rotating over replicas
    picks = {r.pick([1, 2, 3], None, [0, 0, 0]) for _ in range(3)}
    assert picks == {0, 1, 2}


def test_router_map_is_bounded_lru():
    r = Router(2, BLOCK, max_entries=8)
    for i in range(100):
        r.pick([i] * BLOCK, None, [0, 0])
    assert len(r) == 8
    assert r.key([99] * BLOCK) in r._map and r.key([0] * BLOCK) not in r._map
    r.pick([92] * BLOCK, None, [0, 0])  # touching an entry keeps it past newer ones
    r.pick([1000] * BLOCK, None, [0, 0])
    assert r.key([92] * BLOCK) in r._map and r.key([93] * BLOCK) not in r._map


def test_one_replica_always_zero():
    r = Router(1, BLOCK)
    assert r.pick(list(range(100)), None, [50]) == 0


# ----------------------------------------------------------------------------- live server, 2 replicas


class ReplicaServer(ThreadedServer):
    """Like ``server_helpers.LiveServer``, with ``parallel.data_parallel_size: n``."""

    def __init__(self, n: int = 2) -> None:
        cfg = load_pipeline(pipeline(parallel={"data_parallel_size": n}))
        self.engines = build_replicas(cfg)
        super().__init__(build_app(self.engines), Replicas(self.engines), cfg.server.shutdown_grace_s)

    def complete(self, prompt, max_tokens: int = 8, **extra) -> httpx.Response:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r


def test_a_served_engine_captures_its_graphs_before_its_first_client(monkeypatch):
    from modserve.core.engine import Engine

    captured = []
    monkeypatch.setattr(Engine, "capture_graphs", lambda self: captured.append(self))
    engines = build_replicas(load_pipeline(pipeline(parallel={"data_parallel_size": 2})))  # loops not started
    assert captured == [e.engine for e in engines]


@pytest.fixture(scope="module")
def server():
    with ReplicaServer(2) as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    return LLM(pipeline())


def _prefix(seed: int, blocks: int = 5) -> list[int]:
    """Token ids: ``blocks`` full KV blocks unique to ``seed``."""
    return [(seed * 37 + i * 31) % 300 + 50 for i in range(blocks * BLOCK)]


def test_health_models_and_replica_count(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL_NAME]
    assert len(server.app.state.server.replicas) == 2


def test_shared_prefix_lands_on_one_replica_and_hits_its_cache(server):
    prefix = _prefix(1)
    first = server.complete(prefix + [11, 12, 13])
    second = server.complete(prefix + [21, 22])
    replica = first.headers["x-modserve-replica"]
    assert replica in ("0", "1") and second.headers["x-modserve-replica"] == replica
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 4 * BLOCK  # the shared blocks came from that replica's prefix cache
    m = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    assert m[f'modserve:prefix_cache_hits_total{{replica="{replica}"}}'] >= cached


def test_different_prefixes_spread_under_load(server):
    prompts = [_prefix(100 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replicas = list(pool.map(lambda p: server.complete(p, max_tokens=16).headers["x-modserve-replica"], prompts))
    assert set(replicas) == {"0", "1"}, replicas
    # and each prefix keeps its replica afterwards
    again = [server.complete(p + [5]).headers["x-modserve-replica"] for p in prompts]
    assert again == replicas


def test_greedy_outputs_equal_offline(server, llm):
    prompts = [_prefix(200 + i, blocks=2) + [3, 4] for i in range(4)] + [[1, 2, 3]]
    got, seen = [], set()
    for p in prompts:
        r = server.complete(p, max_tokens=12)
        seen.add(r.headers["x-modserve-replica"])
        got.append(r.json()["choices"][0]["text"])
    want = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                     SamplingParams(max_tokens=12, temperature=0))]
    assert got == want
    assert seen == {"0", "1"}  # both replicas produced some of them


def test_per_replica_metrics(server):
    text = httpx.get(f"{server.url}/metrics").text
    # each family once, with both replicas' samples
    assert text.count("# TYPE modserve:generation_tokens_total counter") == 1
    m = parse_metrics(text)
    for r in ("0", "1"):
        assert m[f'modserve:generation_tokens_total{{replica="{r}"}}'] > 0
        assert f'modserve:num_requests_running{{replica="{r}"}}' in m
        assert any(k.startswith("modserve:request_success_total") and f'replica="{r}"' in k for k in m)


def test_cli_replicas_flag_and_sigterm_drain(tmp_path):
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(pipeline()))
    proc, url, line = launch_server(
        ["modserve.cli", "serve", "-c", str(config), "--replicas", "2"], tmp_path / "server.log", timeout=60
    )
    try:
        assert "on 2 replicas" in line, (line, (tmp_path / "server.log").read_text())
        body = {"model": MODEL_NAME, "prompt": _prefix(7), "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
