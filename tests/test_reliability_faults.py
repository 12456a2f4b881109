"""Plugin faults over HTTP: a plugin that raises fails only the requests it touched (500 with
an error JSON naming the plugin) while concurrent good requests complete with the right
output; the engine frees the failed requests' blocks and keeps serving. If the engine loop
itself dies, ``/health`` turns 503 and the server process exits non-zero within seconds."""

from __future__ import annotations

import json
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from reliability_helpers import RegistryServer, error_of, metric, registry, wait_idle
from server_helpers import pipeline, server_process

from modserve import LLM, SamplingParams
from modserve.plugins.kv_backends.paged import PagedKVBackend
from modserve.plugins.samplers.default import DefaultSampler
from modserve.plugins.schedulers.fcfs import FCFSScheduler
from modserve.plugins.speculative.ngram import NgramProposer

C = "/v1/completions"
SAMPLER_SEED, SCHEDULER_TOKEN, PROPOSER_TOKEN, KV_TOKEN, ENQUEUE_TOKEN = 4242, 13, 14, 15, 16
MAX_TOKENS = 24


class FaultySampler(DefaultSampler):
    def _check(self, batch):
        if SAMPLER_SEED in batch.seeds.tolist():
            raise RuntimeError("injected sampler fault")

    def sample(self, logits, batch):
        self._check(batch)
        return super().sample(logits, batch)

    def probs(self, logits, batch):  # the path taken when drafts are verified
        self._check(batch)
        return super().probs(logits, batch)


class FaultyScheduler(FCFSScheduler):
    def add_request(self, request):  # outside the step: while the engine thread enqueues it
        if request.prompt_token_ids[0] == ENQUEUE_TOKEN:
            raise RuntimeError("injected add_request fault")
        return super().add_request(request)

    def _token_count(self, req, remaining, budget):
        if req.prompt_token_ids[0] == SCHEDULER_TOKEN:
            raise RuntimeError("injected scheduler fault")
        return super()._token_count(req, remaining, budget)


class FaultyProposer(NgramProposer):
    def propose(self, requests, k):
        if any(r.prompt_token_ids[0] == PROPOSER_TOKEN for r in requests):
            raise RuntimeError("injected proposer fault")
        return super().propose(requests, k)


class FaultyKV(PagedKVBackend):
    def allocate(self, request, num_new_tokens, prefix_hit=None):
        if request.prompt_token_ids[0] == KV_TOKEN:
            raise RuntimeError("injected KV fault")
        return super().allocate(request, num_new_tokens, prefix_hit)


FAULTY = {"scheduler": {"plugin": "faulty"}, "sampler": {"plugin": "faulty"}, "kv_cache": {"plugin": "faulty"},
          "speculative": {"plugin": "faulty", "num_speculative_tokens": 3}}
# (section, poison request fields, message)
POISONS = [
    ("sampler", {"prompt": [30, 31, 32, 33], "seed": SAMPLER_SEED}, "sampler plugin 'faulty' failed: RuntimeError: injected sampler fault"),
    ("scheduler", {"prompt": [SCHEDULER_TOKEN, 5, 6]}, "scheduler plugin 'faulty' failed: RuntimeError: injected scheduler fault"),
    ("speculative", {"prompt": [PROPOSER_TOKEN, 5, 6, 5, 6, 5]}, "speculative plugin 'faulty' failed: RuntimeError: injected proposer fault"),
    ("kv_cache", {"prompt": [KV_TOKEN, 5, 6]}, "kv_cache plugin 'faulty' failed: RuntimeError: injected KV fault"),
    ("scheduler add_request", {"prompt": [ENQUEUE_TOKEN, 5, 6], "n": 2},
     "scheduler plugin 'faulty' failed: RuntimeError: injected add_request fault"),
]
GOOD = [[20 + i, 21, 22, 20 + i, 21, 22, 23] for i in range(6)]  # repeats, so the ngram proposer drafts


@pytest.fixture(scope="module")
def server():
    reg = registry(samplers={"faulty": FaultySampler}, schedulers={"faulty": FaultyScheduler},
                   speculative_decoders={"faulty": FaultyProposer}, kv_backends={"faulty": FaultyKV})
    with RegistryServer(reg, **FAULTY) as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the good prompts from the offline API with the stock plugins."""
    llm = LLM(pipeline())
    outs = llm.generate([{"prompt_token_ids": p} for p in GOOD], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def _run(url: str, body: dict) -> tuple[int, dict | None, str]:
    """(status, error object or None, text) for a whole or streamed completion."""
    with httpx.Client(timeout=60) as http:
        if not body.get("stream"):
            r = http.post(url + C, json=body)
            if r.status_code != 200:
                return r.status_code, error_of(r), ""
            return 200, None, r.json()["choices"][0]["text"]
        text, error = "", None
        with http.stream("POST", url + C, json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in map(json.loads, events[:-1]):
            if "error" in e:
                error = e["error"]
            else:
                text += e["choices"][0]["text"]
        return r.status_code, error, text


@pytest.mark.parametrize("section,poison,message", POISONS, ids=[p[0] for p in POISONS])
def test_faulty_plugin_fails_only_its_requests(server, reference, section, poison, message):
    base = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    good = [{**base, "prompt": p, "stream": i % 2 == 1} for i, p in enumerate(GOOD)]
    bad = [{**base, **poison}, {**base, **poison, "stream": True}]
    with ThreadPoolExecutor(len(good) + len(bad)) as pool:
        futures = [pool.submit(_run, server.url, b) for b in bad + good]
        results = [f.result() for f in futures]
    (whole_status, whole_err, _), (stream_status, stream_err, _) = results[:2]
    assert whole_status == 500, whole_err
    assert whole_err == {"message": message, "type": "server_error", "param": None, "code": "engine_error"}
    assert stream_status == 200 and stream_err == whole_err  # a stream that had started ends with the error event
    for (status, err, text), want in zip(results[2:], reference):
        assert status == 200 and err is None
        assert text == want  # batched plugin calls were retried per request: the good ones are untouched
    # alone in its step (every entry of the batch fails) it still fails only itself
    assert _run(server.url, {**base, **poison})[:2] == (500, whole_err)
    m = wait_idle(server.url)  # the failed requests' blocks are back in the pool
    assert server.engine.engine.kv.num_free_blocks == server.engine.engine.kv.num_blocks
    assert metric(m, "modserve:request_success_total", finished_reason="error") >= 3
    assert httpx.get(server.url + "/health").status_code == 200


FATAL_PLUGIN = '''
    """An out-of-tree sampler whose fault the engine cannot contain: it raises a BaseException."""
    from modserve.core.contract import hookimpl
    from modserve.plugins.samplers.default import DefaultSampler

    MODSERVE_CONTRACT = "2.0"


    class Fatal(BaseException):
        pass


    class FatalSampler(DefaultSampler):
        def sample(self, logits, batch):
            if 4243 in batch.seeds.tolist():
                raise Fatal("injected fatal fault")
            return super().sample(logits, batch)


    @hookimpl
    def register_samplers():
        return {"fatal": FatalSampler}
'''


def test_engine_loop_death_exits_nonzero(tmp_path, monkeypatch):
    """The loop dies (a plugin raises past the engine's isolation): the in-flight stream and
    the request that killed it get ``engine_dead`` errors, ``/health`` stops answering 200
    and the process exits 1 within seconds. The plugin is installed the out-of-tree way
    (an entry point in the ``modserve`` group) and runs in a real ``serve`` process."""
    plugins = tmp_path / "plugins"
    (plugins / "fatal_plugin-0.1.dist-info").mkdir(parents=True)
    (plugins / "fatal_plugin.py").write_text(textwrap.dedent(FATAL_PLUGIN))
    (plugins / "fatal_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fatal-plugin\nVersion: 0.1\n")
    (plugins / "fatal_plugin-0.1.dist-info" / "entry_points.txt").write_text("[modserve]\nfatal = fatal_plugin\n")
    monkeypatch.setenv("PYTHONPATH", str(plugins))
    proc, url = server_process(tmp_path, sampler={"plugin": "fatal"})
    try:
        with httpx.Client(timeout=30) as http:
            stream = http.stream("POST", url + C, json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True})
            with stream as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # generating
                t0 = time.monotonic()
                killer = http.post(url + C, json={"prompt": "Hi", "max_tokens": 4, "seed": 4243})
                events = [line[6:] for line in lines if line.startswith("data: ")]
            assert killer.status_code == 503
            err = error_of(killer)
            assert err["code"] == "engine_dead"
            assert err["message"] == "engine loop died: sampler plugin 'fatal' failed: Fatal: injected fatal fault"
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
            try:
                health = http.get(url + "/health", timeout=2)
                assert health.status_code == 503 and error_of(health)["code"] == "engine_dead"
            except httpx.TransportError:
                pass  # already closed its socket: also not "healthy"
        assert proc.wait(15) == 1
        exited_after = time.monotonic() - t0
        print(f"\nengine loop death: process exited 1 after {exited_after:.2f}s")
        assert exited_after < 10
        assert "engine loop died" in (tmp_path / "server.log").read_text()
    finally:
        proc.kill()
        proc.wait()
