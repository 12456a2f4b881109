"""Metrics, tracing and cancellation: clients that drop leave nothing running and no KV used."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from server_helpers import MODEL_NAME, LiveServer

from modserve.plugins.observers.tracing import TracingObserver

C = "/v1/completions"
LONG = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True}


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


def test_metrics_names_and_labels():
    with LiveServer() as s:
        s.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        text = httpx.get(f"{s.url}/metrics").text
        for name in [
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
            "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
            "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
            "request_queue_time_seconds_count", "request_prompt_tokens_count", "request_generation_tokens_count",
        ]:
            assert f'modserve:{name}{{model_name="{MODEL_NAME}"}}' in text, name
        assert f'modserve:request_success_total{{finished_reason="length",model_name="{MODEL_NAME}"}} 1.0' in text
        m = s.metrics()
        assert m["modserve:generation_tokens_total"] == 5 and m["modserve:request_generation_tokens_sum"] == 5
        assert m["modserve:prompt_tokens_total"] == m["modserve:request_prompt_tokens_sum"] > 0


def test_disconnects_abort_and_free_kv():
    with LiveServer() as s, contextlib.ExitStack() as stack:
        http = stack.enter_context(httpx.Client())
        lines = []  # kept: dropping a partly read iterator closes its response
        for _ in range(4):
            lines.append(stack.enter_context(http.stream("POST", s.url + C, json={**LONG, "stream": True})).iter_lines())
            assert next(lines[-1]).startswith("data: {")
        assert s.metrics()["modserve:num_requests_running"] == 4
        stack.close()  # drop all four mid-stream
        with pytest.raises(httpx.ReadTimeout):  # drop while waiting for a whole (non-streamed) response
            httpx.post(s.url + C, json=LONG, timeout=0.3)

        def settled():
            m = s.metrics()
            aborted = m.get('modserve:request_success_total{finished_reason="abort",}', 0)
            return aborted == 5 and m["modserve:num_requests_running"] == 0 and m["modserve:kv_cache_usage_perc"] == 0
        wait_for(settled)
        assert s.metrics().get('modserve:request_success_total{finished_reason="length",}', 0) == 0


def test_tracing_joins_the_incoming_trace():
    with LiveServer(observers=[{"plugin": "metrics"}, {"plugin": "tracing", "exporter": "console"}]) as s:
        memory = InMemorySpanExporter()
        (tracing,) = [o for o in s.app.state.server.engine.engine.c.observers if isinstance(o, TracingObserver)]
        tracing.provider.add_span_processor(SimpleSpanProcessor(memory))
        trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "ignore_eos": True}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
        assert r.status_code == 200
        spans = wait_for(lambda: len(memory.get_finished_spans()) == 2 and memory.get_finished_spans())
        for span in spans:
            assert span.context.trace_id == int(trace_id, 16) and span.parent.span_id == int(parent_id, 16)
            assert span.name == f"chat {MODEL_NAME}"
            attrs = span.attributes
            assert attrs["gen_ai.request.model"] == MODEL_NAME and attrs["gen_ai.response.id"] == r.json()["id"]
            assert attrs["gen_ai.usage.output_tokens"] == 4 and attrs["gen_ai.usage.input_tokens"] > 0
            assert list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
            assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]
        untraced = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert untraced.status_code == 200
        root = wait_for(lambda: len(memory.get_finished_spans()) == 3 and memory.get_finished_spans()[-1])
        assert root.parent is None and root.name == f"text_completion {MODEL_NAME}"
