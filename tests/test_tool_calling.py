"""Tool calling, reasoning and chat prompt_logprobs over real HTTP with the ``openai`` SDK and
the embedded SmolLM2: required and named choices always return calls whose arguments
validate against the tool's schema, in a batch mixed with plain requests; streamed calls
reassemble to the same call; ``auto`` reads calls out of the model's text; earlier calls
and ``role: tool`` results go back into the conversation."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from server_helpers import LiveServer

pytestmark = pytest.mark.slow

MODEL = "smollm2"


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    unit: Literal["C", "F"]


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tz: str = Field(max_length=10)


def _tool(name: str, model: type[BaseModel], description: str) -> dict:
    schema = model.model_json_schema()
    schema.pop("title", None)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


WEATHER = _tool("get_weather", WeatherArgs, "The current weather in a city")
TIME = _tool("get_time", TimeArgs, "The time in a time zone")
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    with LiveServer(model={"path": "smollm2-135m-instruct", "name": MODEL, "max_model_len": 1024},
                    kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 512}) as s:
        yield s


def _valid(call) -> bool:
    ARGS[call.function.name].model_validate_json(call.function.arguments)
    return call.type == "function" and call.id.startswith("call_")


def test_required_and_named_choices_always_return_valid_calls_in_a_mixed_batch(server):
    client = server.client()
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Rome", "Delhi"]

    def ask(i):
        messages = [{"role": "user", "content": f"What's the weather in {cities[i % 8]}, and what time is it there?"}]
        if i % 3 == 2:  # a plain request in the same batches
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=i)
            return r.choices[0]
        choice = "required" if i % 3 == 0 else NAMED
        # one call each: sampled freely, a 135M model may go on calling until max_tokens
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                                           temperature=1.0, seed=i, max_tokens=120, parallel_tool_calls=False)
        return r.choices[0]

    with ThreadPoolExecutor(24) as pool:
        choices = list(pool.map(ask, range(24)))
    for i, c in enumerate(choices):
        if i % 3 == 2:
            assert c.message.tool_calls is None and c.message.content
            continue
        assert len(c.message.tool_calls) == 1 and _valid(c.message.tool_calls[0]), c.message
        assert c.message.content is None
        assert c.finish_reason == ("tool_calls" if i % 3 == 0 else "stop")
        if i % 3 == 1:
            assert [call.function.name for call in c.message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_streamed_call_reassembles_to_the_same_call(server, choice):
    client = server.client()
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                assert d.id is None or d.id == call["id"]  # the id comes once, with the name
                call["arguments"] += d.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert finish == whole.finish_reason


HERMES_CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "CET"\}\}\n</tool_call>'


def test_auto_reads_the_call_the_model_writes(server):
    """``auto`` with the pipeline's hermes parser; the test makes the model write a call by
    constraining its text with a regex (the parser does not know that)."""
    client = server.client()
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
                  extra_body={"structured_outputs": {"regex": "Let me look\\.\\n" + HERMES_CALL}})
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me look."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [("get_time", {"tz": "CET"})]
    content, calls = "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            calls.append((d.function.name, json.loads(d.function.arguments)))
        content += chunk.choices[0].delta.content or ""
    assert content == "Let me look." and calls == [("get_time", {"tz": "CET"})]
    free = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=24, temperature=0).choices[0]
    assert free.message.content and "<tool_call>" not in free.message.content  # plain text stays text


def test_tool_results_go_back_into_the_conversation(server):
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=120).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    without_call = messages[:1] + [{"role": "assistant", "content": ""}] + messages[2:]
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": without_call}).json()["count"]
    assert answer.usage.prompt_tokens >= tokens + 10  # the earlier call was rendered into the prompt, not dropped


def test_bad_tools_are_400s_naming_the_field(server):
    url = f"{server.url}/v1/chat/completions"
    base = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    cases = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                             "function": {"name": "f", "arguments": "nope"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_chat_prompt_logprobs(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    rows = r.model_extra["prompt_logprobs"]
    assert len(rows) == r.usage.prompt_tokens and rows[0] is None
    assert all(2 <= len(row) <= 3 for row in rows[1:])  # the top 2, and the prompt's own token if not among them
    streamed = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, stream=True,
                                                   extra_body={"prompt_logprobs": 2}))
    assert streamed[0].model_extra["prompt_logprobs"] == rows
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in streamed[1:])


def test_a_reasoning_parser_fills_reasoning_content_and_reasoning_items():
    """``think`` with ``starts_in_reasoning`` (a template that opens the block in the prompt) and
    ``.`` as the end marker, so SmolLM2's first sentence is its "reasoning"."""
    with LiveServer(model={"path": "smollm2-135m-instruct", "name": MODEL, "max_model_len": 512},
                    kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 128},
                    reasoning_parser={"plugin": "think", "end": ".", "starts_in_reasoning": True}) as s:
        client = s.client()
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris in three sentences."}],
                      max_tokens=40, temperature=0)
        msg = client.chat.completions.create(**kwargs).choices[0].message
        thinking, answer = msg.model_extra["reasoning_content"], msg.content
        assert thinking and "." not in thinking and answer
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for key in streamed:
                streamed[key] += (chunk.choices[0].delta.model_extra or {}).get(key) or getattr(chunk.choices[0].delta, key, None) or ""
        assert streamed == {"reasoning_content": thinking, "content": answer}
        constrained = client.chat.completions.create(**kwargs, extra_body={"structured_outputs": {"choice": ["Paris."]}})
        assert constrained.choices[0].message.content == "Paris."  # a grammar leaves no thinking to split off
        r = client.responses.create(model=MODEL, input=kwargs["messages"][0]["content"], max_output_tokens=40, temperature=0)
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert (r.output[0].content[0].text, r.output_text) == (thinking, answer)
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = list(client.responses.create(model=MODEL, input=kwargs["messages"][0]["content"], max_output_tokens=40,
                                              temperature=0, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
        assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
