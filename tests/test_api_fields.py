"""No silently ignored parameter: a known field the server does not support is a 400 naming
it (unless its value asks for nothing), an unknown field is ignored and logged once."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from server_helpers import MODEL_NAME, LiveServer

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2}
FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}

REFUSED = [
    ("/v1/chat/completions", CHAT, "functions", [FUNCTION]),
    ("/v1/chat/completions", CHAT, "function_call", "auto"),
    ("/v1/chat/completions", CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", CHAT, "modalities", ["text", "audio"]),
    ("/v1/chat/completions", CHAT, "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", CHAT, "web_search_options", {}),  # {} asks for nothing ...
    ("/v1/chat/completions", CHAT, "store", True),
    ("/v1/completions", COMPLETION, "best_of", 3),
    ("/v1/completions", COMPLETION, "guided_decoding_backend", "xgrammar"),  # would not be what runs
    ("/v1/completions", COMPLETION, "suffix", "tail"),
    ("/v1/responses", RESPONSE, "previous_response_id", "resp_123"),
    ("/v1/responses", RESPONSE, "store", True),
    ("/v1/responses", RESPONSE, "conversation", "conv_1"),
    ("/v1/responses", RESPONSE, "background", True),
    ("/v1/responses", RESPONSE, "include", ["message.output_text.logprobs"]),
    ("/v1/responses", RESPONSE, "reasoning", {"effort": "high"}),
    ("/v1/responses", RESPONSE, "truncation", "auto"),
    ("/v1/responses", RESPONSE, "top_logprobs", 3),
]
HARMLESS = [
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [],
                                    "modalities": ["text"], "store": False}),
    ("/v1/completions", COMPLETION, {"best_of": 1, "suffix": None, "use_beam_search": False,
                                     "guided_decoding_backend": "guidance"}),
    ("/v1/responses", RESPONSE, {"store": False, "truncation": "disabled", "reasoning": {"effort": None},
                                 "include": [], "previous_response_id": None}),
]


@pytest.fixture(scope="module")
def server():
    with LiveServer() as s:
        yield s


@pytest.mark.parametrize("path,base,field,value", REFUSED, ids=[f"{p.split('/')[-1]}-{f}" for p, _, f, _ in REFUSED])
def test_a_known_unsupported_field_is_a_400_naming_it(server, path, base, field, value):
    if value == {}:
        value = {"search_context_size": "low"}  # ... so ask for something
    name = field
    r = httpx.post(server.url + path, json={**base, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "unsupported_parameter"
    assert err["message"].startswith(f"{name}: not supported by this server")


@pytest.mark.parametrize("path,base,extra", HARMLESS, ids=["chat", "completions", "responses"])
def test_values_that_ask_for_nothing_pass(server, path, base, extra):
    r = httpx.post(server.url + path, json={**base, **extra})
    assert r.status_code == 200, r.text


def test_an_unknown_field_is_ignored_and_logged_once(server, caplog):
    with caplog.at_level(logging.INFO, logger="modserve.server"):
        for _ in range(2):
            r = httpx.post(server.url + "/v1/completions", json={**COMPLETION, "x_vendor_hint": {"a": 1}})
            assert r.status_code == 200
    logged = [rec for rec in caplog.records if "x_vendor_hint" in rec.getMessage()]
    assert len(logged) == 1 and "ignoring unknown request field" in logged[0].getMessage()


def test_the_openai_sdk_gets_a_clear_error_instead_of_an_ignored_field(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="functions: not supported by this server: the deprecated functions API"):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=4, functions=[FUNCTION])
    with pytest.raises(openai.BadRequestError, match="previous_response_id: not supported by this server"):
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_1")
