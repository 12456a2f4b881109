"""Every configured limit is enforced with a clear 400/413 (or 504 for the wall-time limit),
and a request at the limit is still served. A timed-out request frees its KV blocks."""

from __future__ import annotations

import json

import httpx
import pytest
from reliability_helpers import RegistryServer, SlowScheduler, error_of, metric, registry, wait_idle

C, CHAT = "/v1/completions", "/v1/chat/completions"
LIMITS = dict(
    max_body_bytes=2048, max_n=3, max_stop_strings=2, max_stop_string_len=8, max_top_logprobs=3, max_messages=4,
    max_waiting_requests=8, max_prompt_tokens=48, max_output_tokens=10,
)
MSG = [{"role": "user", "content": "hi"}]
PROMPT_48 = list(range(30, 78))


@pytest.fixture(scope="module")
def server():
    with RegistryServer(model={"max_model_len": 96}, server=LIMITS) as s:
        yield s


# (case, path, body, status, param, code, words the message must contain)
OVER = [
    ("body size (declared)", C, {"prompt": "x" * 3000}, 413, None, "request_too_large", ["2048", "max_body_bytes"]),
    ("prompt tokens", C, {"prompt": PROMPT_48 + [50], "max_tokens": 2}, 400, "prompt", "prompt_too_long", ["49", "48", "max_prompt_tokens"]),
    ("prompt tokens (batch)", C, {"prompt": [[1, 2], PROMPT_48 + [50]], "max_tokens": 2}, 400, "prompt", "prompt_too_long", ["49"]),
    ("chat prompt tokens", CHAT, {"messages": [{"role": "user", "content": "Hello world " * 30}]}, 400, "messages", "prompt_too_long", ["max_prompt_tokens"]),
    ("max_tokens", C, {"prompt": "x", "max_tokens": 11}, 400, "max_tokens", None, ["<= 10", "11", "max_output_tokens"]),
    ("max_completion_tokens", CHAT, {"messages": MSG, "max_completion_tokens": 11}, 400, "max_completion_tokens", None, ["<= 10"]),
    ("n", C, {"prompt": "x", "max_tokens": 2, "n": 4}, 400, "n", None, ["<= 3", "max_n"]),
    ("stop count", C, {"prompt": "x", "max_tokens": 2, "stop": ["a", "b", "c"]}, 400, "stop", None, ["at most 2", "max_stop_strings"]),
    ("stop length", CHAT, {"messages": MSG, "max_tokens": 2, "stop": "123456789"}, 400, "stop", None, ["<= 8"]),
    ("top_logprobs", CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 4}, 400, "top_logprobs", None, ["<= 3"]),
    ("logprobs", C, {"prompt": "x", "max_tokens": 2, "logprobs": 4}, 400, "logprobs", None, ["<= 3"]),
    ("messages", CHAT, {"messages": MSG * 5, "max_tokens": 2}, 400, "messages", None, ["at most 4", "max_messages"]),
    ("batch x n over the waiting bound", C, {"prompt": [[1]] * 3, "n": 3, "max_tokens": 2}, 400, "prompt", "batch_too_large",
     ["9 sequences", "max_waiting_requests"]),
    ("empty cache_salt", C, {"prompt": "x", "max_tokens": 2, "cache_salt": ""}, 400, "cache_salt", None, ["non-empty"]),
]


@pytest.mark.parametrize("case,path,body,status,param,code,words", OVER, ids=[c[0] for c in OVER])
def test_over_the_limit(server, case, path, body, status, param, code, words):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert all(w in err["message"] for w in words), err["message"]


def test_body_size_without_content_length(server):
    """A chunked body carries no Content-Length: the limit is enforced while reading."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 300
        yield b'"}'

    r = httpx.post(server.url + C, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"


def test_at_the_limit_is_served(server):
    r = httpx.post(server.url + C, json={"prompt": PROMPT_48, "max_tokens": 10, "n": 3, "stop": ["12345678", "x"],
                                         "logprobs": 3, "ignore_eos": True, "cache_salt": "t"})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    chat = httpx.post(server.url + CHAT, json={"messages": MSG * 4, "logprobs": True, "top_logprobs": 3, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    # no max_tokens: the room left in max_model_len, capped by server.max_output_tokens
    assert chat.json()["usage"]["completion_tokens"] == 10
    wait_idle(server.url)


def test_wall_time_limit_frees_blocks():
    """Past ``server.request_timeout_s`` a request gets 504 (or a timeout error event in a
    stream) and is aborted: running and queued ones alike leave the KV cache empty."""
    reg = registry(schedulers={"slow": SlowScheduler})  # 10 ms per step: 400 tokens take seconds
    with RegistryServer(reg, scheduler={"plugin": "slow", "max_num_seqs": 1}, server={"request_timeout_s": 0.5}) as s, \
            httpx.Client(timeout=30) as http:
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
        with http.stream("POST", s.url + C, json={**body, "stream": True}) as streamed:
            queued = http.post(s.url + C, json=body)  # waits behind the stream for the only seat, then times out
            assert queued.status_code == 504 and error_of(queued)["code"] == "timeout"
            events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "timeout" and "request_timeout_s" in err["message"]
        assert len(events) > 3  # it was generating when the limit struck
        m = wait_idle(s.url)
        assert metric(m, "modserve:request_success_total", finished_reason="abort") == 2
        ok = http.post(s.url + C, json={"prompt": "Hello", "max_tokens": 3})
        assert ok.status_code == 200  # still serving
