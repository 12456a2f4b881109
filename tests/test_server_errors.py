"""Every client error is OpenAI's error JSON with the right status; auth; overload (503)."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import MODEL_NAME, LiveServer

KEY, ENV_KEY = "sk-test-key", "sk-from-env"
AUTH = {"Authorization": f"Bearer {KEY}"}
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG_PROMPT = list(range(10, 110))  # 100 token ids


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TEST_MODSERVE_KEYS", f" {ENV_KEY} , ")
        limits = dict(max_n=4, max_stop_strings=2, max_top_logprobs=5, max_body_bytes=4096)
        server = LiveServer(
            model={"max_model_len": 128},
            server={"api_keys": [KEY], "api_keys_env": "TEST_MODSERVE_KEYS", **limits},
        )
    with server as s:
        yield s


# (case, method, path, body: dict | bytes, status, param, code, words the message must contain)
ERRORS = [
    ("malformed JSON", "POST", C, b'{"prompt": "x",', 400, None, "invalid_json", ["invalid JSON"]),
    ("body not an object", "POST", C, b"[1, 2]", 400, None, None, ["expected object"]),
    ("missing field", "POST", C, {"max_tokens": 2}, 400, "prompt", None, ["prompt", "missing"]),
    ("string for int", "POST", C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None, ["expected int"]),
    ("bool for int", "POST", C, {"prompt": "x", "n": True}, 400, "n", None, ["expected int"]),
    ("wrong type in messages", "POST", CHAT, {"messages": "hi"}, 400, "messages", None, ["expected array"]),
    ("wrong role type", "POST", CHAT, {"messages": [{"role": 1, "content": "x"}]}, 400, "messages[0].role", None, []),
    ("max_tokens 0", "POST", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None, [">= 1"]),
    ("max_completion_tokens 0", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens", None, []),
    ("temperature above 2", "POST", C, {"prompt": "x", "temperature": 2.5}, 400, "temperature", None, ["[0, 2]", "2.5"]),
    ("temperature below 0", "POST", CHAT, {"messages": MSG, "temperature": -0.1}, 400, "temperature", None, ["-0.1"]),
    ("top_p 0", "POST", C, {"prompt": "x", "top_p": 0}, 400, "top_p", None, ["(0, 1]"]),
    ("top_p above 1", "POST", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None, ["1.5"]),
    ("n 0", "POST", C, {"prompt": "x", "n": 0}, 400, "n", None, [">= 1"]),
    ("n above max_n", "POST", CHAT, {"messages": MSG, "n": 5}, 400, "n", None, ["<= 4", "5"]),
    ("too many stop strings", "POST", C, {"prompt": "x", "stop": ["a", "b", "c"]}, 400, "stop", None, ["at most 2"]),
    ("top_logprobs above max", "POST", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 6}, 400, "top_logprobs", None, ["<= 5"]),
    ("logprobs above max", "POST", C, {"prompt": "x", "logprobs": 6}, 400, "logprobs", None, ["<= 5"]),
    ("top_logprobs without logprobs", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", None, ["logprobs"]),
    ("prompt + max_tokens > max_model_len", "POST", C, {"prompt": LONG_PROMPT, "max_tokens": 50}, 400, "prompt",
     "context_length_exceeded", ["128", "100", "50", "150"]),
    ("chat + max_tokens > max_model_len", "POST", CHAT, {"messages": MSG, "max_tokens": 127}, 400, "messages",
     "context_length_exceeded", ["128", "127"]),
    ("empty prompt", "POST", C, {"prompt": []}, 400, "prompt", None, ["empty"]),
    ("empty token prompt", "POST", C, {"prompt": [[]]}, 400, "prompt", None, ["at least one token"]),
    ("out-of-vocabulary prompt", "POST", C, {"prompt": [10**6]}, 400, "prompt", None, ["vocabulary"]),
    ("mixed prompt list", "POST", C, {"prompt": ["a", 1]}, 400, "prompt", None, ["list of strings"]),
    ("stop id outside vocabulary", "POST", C, {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids", None, []),
    ("seed beyond int64", "POST", C, {"prompt": "x", "seed": 2**63}, 400, "seed", None, []),
    ("presence_penalty out of range", "POST", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None, []),
    ("min_tokens above max_tokens", "POST", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens", None, []),
    ("no messages", "POST", CHAT, {"messages": []}, 400, "messages", None, ["at least one"]),
    ("image content part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", None, ["image_url"]),
    ("detokenize outside vocabulary", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens", None, []),
    ("tokenize without input", "POST", "/tokenize", {}, 400, "prompt", None, []),
    ("unknown model", "POST", C, {"model": "gpt-9", "prompt": "x"}, 404, "model", "model_not_found", ["gpt-9"]),
    ("unknown model in chat", "POST", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model", "model_not_found", []),
    ("unknown route", "POST", "/v1/embeddings", {"input": "x"}, 404, None, "not_found", ["/v1/embeddings"]),
    ("wrong method", "GET", C, None, 405, None, None, []),
    ("body over max_body_bytes", "POST", C, {"prompt": "x" * 5000}, 413, None, "request_too_large", ["4096"]),
    ("missing API key", "POST", C, {"prompt": "x"}, 401, None, "invalid_api_key", ["API key"]),
    ("wrong API key", "POST", C, {"prompt": "x"}, 401, None, "invalid_api_key", []),
    ("wrong auth scheme", "POST", C, {"prompt": "x"}, 401, None, "invalid_api_key", []),
]
BAD_AUTH = {"missing API key": {}, "wrong API key": {"Authorization": "Bearer sk-wrong"},
            "wrong auth scheme": {"Authorization": f"Basic {KEY}"}}


@pytest.mark.parametrize("case,method,path,body,status,param,code,words", ERRORS, ids=[e[0] for e in ERRORS])
def test_error(server, case, method, path, body, status, param, code, words):
    headers = BAD_AUTH.get(case, AUTH)
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    r = httpx.request(method, server.url + path, content=content, headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["type"], str)
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert all(w in err["message"] for w in words), err["message"]


def test_extra_fields_are_ignored(server):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "best_of": 1, "logit_bias": {}, "vendor": {"a": [1]}}
    r = httpx.post(server.url + C, json=body, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_auth(server):
    assert httpx.get(server.url + "/health").status_code == 200  # exempt
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers=AUTH).status_code == 200
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    for key in (KEY, ENV_KEY):  # from server.api_keys and from the variable named by api_keys_env
        res = server.client(api_key=key).completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
        assert res.usage.completion_tokens <= 2


def test_overload_gives_503_with_retry_after():
    with LiveServer(scheduler={"max_num_seqs": 1}, server={"max_waiting_requests": 1}) as s, httpx.Client() as http:
        body = {"prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with http.stream("POST", s.url + C, json=body) as running:
            lines = running.iter_lines()  # kept: dropping a partly read iterator closes the response
            next(lines)  # it holds the only seat
            with http.stream("POST", s.url + C, json=body) as waiting:
                assert waiting.status_code == 200  # queued: the one allowed waiting request
                r = http.post(s.url + C, json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                err = r.json()["error"]
                assert err["code"] == "overloaded" and "max_waiting_requests" in err["message"]


def test_request_timeout():
    with LiveServer(server={"request_timeout_s": 0.3}) as s:
        body = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
        r = httpx.post(s.url + C, json=body)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        lines = [x for x in httpx.post(s.url + C, json={**body, "stream": True}).text.splitlines() if x]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "timeout"
