"""``POST /v1/responses`` over real HTTP with the ``openai`` SDK and the embedded SmolLM2:
text and streamed answers (the Responses event sequence), structured output through
``text.format``, function calls and their outputs sent back as input items, and a 400
naming the Responses field (not the chat field it maps to) for a bad request."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field
from server_helpers import LiveServer

pytestmark = pytest.mark.slow

MODEL = "smollm2"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)


@pytest.fixture(scope="module")
def server():
    with LiveServer(model={"path": "smollm2-135m-instruct", "name": MODEL, "max_model_len": 1024},
                    kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 512}) as s:
        yield s


def test_create_answers_like_chat(server):
    client = server.client()
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=24, temperature=0)
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.status == "completed" and r.store is False and [item.type for item in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    cut = client.responses.create(model=MODEL, input="Tell me about Paris.", max_output_tokens=3,
                                  instructions="You are a tour guide.", metadata={"ticket": "42"})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.instructions == "You are a tour guide." and cut.metadata == {"ticket": "42"}
    as_chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": "You are a tour guide."}, {"role": "user", "content": "Tell me about Paris."}])
    assert cut.usage.input_tokens == as_chat.usage.prompt_tokens  # the instructions are the system message


def test_streaming_sends_the_response_events_in_order(server):
    client = server.client()
    kwargs = dict(model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == client.responses.create(**kwargs).output_text


def test_text_format_gives_parsed_objects(server):
    r = server.client().responses.parse(model=MODEL, input="Give the capital of Spain as JSON.", text_format=Capital,
                                        max_output_tokens=80, temperature=0)
    assert isinstance(r.output_parsed, Capital)


def test_function_calls_and_their_outputs_round_trip(server):
    client = server.client()
    r = client.responses.create(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    events = list(client.responses.create(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.output_item.done")
    assert done.item.type == "function_call" and done.item.arguments == arguments == call.arguments
    follow = client.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0,
                                     input=[{"role": "user", "content": "What's the weather in Paris?"},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}])
    assert follow.output_text and follow.output[0].type == "message"


@pytest.mark.parametrize("extra,param,message", [
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "text.format.schema: required"),
    ({"tools": [{"type": "function"}]}, "tools[0].name", "tools[0].name: required for a function tool"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "tools[0].type: only 'function' tools are supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "tool_choice.name: no tool named 'nope'"),
    ({"input": []}, "input", "input: must contain at least one item"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "input[0].type: only message"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]",
     "input[0].content[0]: only text parts are supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "input[0].call_id: required"),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c", "arguments": "[1]"}]}, "input[0].arguments",
     "input[0].arguments: must be a JSON object's text"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "text.verbosity: not supported by this server"),
])
def test_a_bad_request_names_the_responses_field(server, extra, param, message):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err
