"""Security defaults: loopback bind unless told otherwise, constant-time key comparison,
no prompt or output text in logs unless ``server.log_prompts``, and prefix-cache isolation
by ``cache_salt`` over HTTP (hash seeding keeps tenants apart; token comparison refuses a
block whose hash matches but whose tokens do not)."""

from __future__ import annotations

import hashlib
import json
import logging
import types

import httpx
import pytest
from reliability_helpers import wait_idle
from server_helpers import LiveServer, pipeline

from modserve.core.config import load_pipeline
from modserve.server import app as server_app
from modserve.server import auth
from modserve.plugins.kv_backends import paged
from modserve.plugins.kv_backends.block_pool import BlockPool

C, CHAT = "/v1/completions", "/v1/chat/completions"


def test_binds_loopback_by_default(monkeypatch, capsys):
    assert load_pipeline({}).server.host == "127.0.0.1"
    bound = []
    real_bind = server_app.bind

    def record_bind(host, port):
        sock = real_bind(host, port)
        bound.append(sock.getsockname()[0])
        sock.close()
        raise OSError("stop after binding")  # enough: the test is about the address

    monkeypatch.setattr(server_app, "bind", record_bind)
    config = pipeline()
    del config["server"]  # no server section at all: the defaults
    assert server_app.serve(config, port=0) == 1
    assert bound == ["127.0.0.1"]
    assert "stop after binding" in capsys.readouterr().err


def test_keys_compared_in_constant_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ["sk-first", "sk-second", "sk-third"]
    mw = auth.AuthMiddleware(app=None, keys=keys, exempt_paths=["/health"])
    for header, ok in [(b"Bearer sk-first", True), (b"Bearer sk-third", True), (b"Bearer sk-firs", False), (b"Bearer ", False)]:
        calls.clear()
        assert mw._authorized({"headers": [(b"authorization", header)]}) is ok
        assert calls == [(bytes, bytes)] * len(keys)  # every key compared, no early exit on a match or a mismatch
    source = open(auth.__file__).read()
    assert "compare_digest" in source and "== token" not in source and "token ==" not in source


SECRET = "zebra-octopus-saxophone"


def _all_log_text(caplog) -> str:
    return "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)


@pytest.mark.parametrize("log_prompts", [False, True])
def test_no_prompt_or_output_text_in_logs(caplog, log_prompts):
    caplog.set_level(logging.DEBUG)  # every logger, every level
    with LiveServer(server={"log_prompts": log_prompts}) as s, httpx.Client(timeout=60) as http:
        base = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
        whole = http.post(s.url + C, json={**base, "prompt": f"My password is {SECRET}"}).json()
        streamed = http.post(s.url + CHAT, json={**base, "messages": [{"role": "user", "content": SECRET}], "stream": True})
        chat = http.post(s.url + CHAT, json={**base, "messages": [{"role": "user", "content": SECRET}]}).json()
        bad = http.post(s.url + C, json={**base, "prompt": SECRET, "temperature": 9})  # an error path too
        assert bad.status_code == 400 and SECRET not in bad.text
        outputs = [whole["choices"][0]["text"], chat["choices"][0]["message"]["content"]]
        assert all(len(o) >= 10 for o in outputs) and streamed.status_code == 200
        wait_idle(s.url)
    text = _all_log_text(caplog)
    access = [r.getMessage() for r in caplog.records if r.name == "modserve.access" and "/v1/" in r.getMessage()]
    assert len(access) == 4
    forms = [f for o in outputs for f in (o, json.dumps(o, ensure_ascii=False)[1:-1])]  # raw and as logged
    if not log_prompts:
        assert SECRET not in text
        assert not any(f in text for f in forms)
    else:  # opted in: the access lines carry prompts and outputs
        assert SECRET in text and all(json.dumps(o, ensure_ascii=False)[1:-1] in text for o in outputs)


PROMPT = list(range(40, 104))  # 64 token ids: 3 full blocks of 16 can be reused (the last token is recomputed)


def _cached(http: httpx.Client, url: str, salt: str | None, prompt=PROMPT, stream=False) -> int:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", url + C, json=body) as r:
            usage = [line for line in r.iter_lines() if '"usage":{' in line][-1]
        return httpx.Response(200, content=usage[6:]).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    r = http.post(url + C, json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_isolates_tenants():
    with LiveServer() as s, httpx.Client(timeout=60) as http:
        assert _cached(http, s.url, "tenant-a") == 0
        assert _cached(http, s.url, "tenant-a") == 48  # its own prefix: 3 blocks
        assert _cached(http, s.url, "tenant-b") == 0  # same tokens, other tenant: nothing
        assert _cached(http, s.url, None) == 0  # nor for requests without a salt
        assert _cached(http, s.url, "tenant-b", stream=True) == 48  # streamed usage reports it too
        assert _cached(http, s.url, None) == 48
        chat = {"messages": [{"role": "user", "content": "Hello, world! " * 8}], "max_tokens": 2}
        first = http.post(s.url + CHAT, json={**chat, "cache_salt": "tenant-c"}).json()["usage"]
        other = http.post(s.url + CHAT, json={**chat, "cache_salt": "tenant-d"}).json()["usage"]
        again = http.post(s.url + CHAT, json={**chat, "cache_salt": "tenant-c"}).json()["usage"]
        assert first["prompt_tokens_details"]["cached_tokens"] == other["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["prompt_tokens_details"]["cached_tokens"] > 0
        wait_idle(s.url)


class _TokenBlindBlake2b:
    """blake2b that ignores the block's token ids: every block hash depends only on the salt and
    the block's position, so blocks with different tokens collide on purpose."""

    def __init__(self, **kw):
        self._h, self._updates = hashlib.blake2b(**kw), 0

    def update(self, data):
        self._updates += 1
        if self._updates == 1:  # the salt or the parent hash; the token ids come second
            self._h.update(data)

    def digest(self):
        return self._h.digest()


def test_hash_collision_is_refused_by_token_comparison(monkeypatch):
    """With hashes that collide for different tokens, a lookup still compares the stored
    block's token ids: another prompt gets no cached tokens and the right output."""
    monkeypatch.setattr(paged, "hashlib", types.SimpleNamespace(blake2b=_TokenBlindBlake2b))
    lookups = []  # (a block with this hash is cached, the lookup returned it)
    real_lookup = BlockPool.lookup

    def spy(self, block_hash, tokens):
        found = real_lookup(self, block_hash, tokens)
        lookups.append((block_hash in self.cached, found is not None))
        return found

    monkeypatch.setattr(BlockPool, "lookup", spy)
    other = [t + 100 for t in PROMPT]  # same length, different tokens, same salt: colliding hashes
    with LiveServer() as s, httpx.Client(timeout=60) as http:
        assert _cached(http, s.url, "tenant-a") == 0
        lookups.clear()
        assert _cached(http, s.url, "tenant-a", prompt=other) == 0
        assert lookups == [(True, False)]  # the hash matched a cached block; its tokens did not: refused
        assert _cached(http, s.url, "tenant-a") == 48  # a true hit still works
        body = {"prompt": other, "max_tokens": 8, "temperature": 0, "cache_salt": "tenant-a"}
        colliding = http.post(s.url + C, json=body).json()  # hash-hits tenant-a's blocks, must not use them
        assert colliding["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_idle(s.url)
    with LiveServer() as clean, httpx.Client(timeout=60) as http:
        want = http.post(clean.url + C, json=body).json()
    assert colliding["choices"][0]["text"] == want["choices"][0]["text"]
