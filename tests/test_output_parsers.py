"""Tool-call and reasoning parsers, and the chat output reader built on them.

The parsers are called on the output so far as it grows; every result must extend the
last (what was streamed cannot be taken back), and the final result must lose no text: a
malformed or unfinished call stays content. The tool plan turns ``tools`` and
``tool_choice`` into a grammar and a prompt, with a 400 naming the field for a bad one."""

from __future__ import annotations

import json

import msgspec
import pytest

from modserve.core.contract import ToolCall
from modserve.core.tokenizer import TokenizerBundle
from modserve.plugins.reasoning_parsers.think import ThinkConfig, ThinkReasoningParser
from modserve.plugins.tool_parsers.hermes import HermesToolParser
from modserve.plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from modserve.server.chat_output import ChoiceReader
from modserve.server.errors import APIError
from modserve.server.protocol import ChatCompletionRequest
from modserve.server.tool_calls import plan_tools, render_messages

HERMES = HermesToolParser(None, None)
LLAMA3 = Llama3JsonToolParser(None, None)
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
UTC = ToolCall("get_time", '{"tz": "UTC"}')


def _grow(parse, text):
    """Parse every prefix of ``text``; assert each result extends the last; the final result."""
    prev = None
    for i in range(len(text) + 1):
        r = parse(text[:i], False)
        if prev is not None:
            assert r.content.startswith(prev.content), (text[:i], prev, r)
            assert r.calls[: len(prev.calls)] == prev.calls, (text[:i], prev, r)
        prev = r
    final = parse(text, True)
    assert final.content.startswith(prev.content) and final.calls[: len(prev.calls)] == prev.calls
    return final


@pytest.mark.parametrize("text,content,calls", [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', "Let me check.", [PARIS, UTC]),
    ("Paris is sunny.", "Paris is sunny.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> Done.', "Done.", [PARIS]),
    ("<tool_call>{not json}</tool_call> x", "<tool_call>{not json}</tool_call> x", []),  # malformed: stays text
    ('<tool_call>{"name": "get_weather", "arguments": {"ci', '<tool_call>{"name": "get_weather", "arguments": {"ci', []),
    ("a < b, <tool_ca", "a < b, <tool_ca", []),  # a partial marker at the end is text once the output ends
])
def test_hermes_reads_calls_as_the_text_grows(text, content, calls):
    final = _grow(HERMES.parse, text)
    assert (final.content, final.calls) == (content, calls)


def test_hermes_holds_back_a_partial_marker_while_streaming():
    assert HERMES.parse("Sure <tool_", False).content == "Sure"
    assert HERMES.parse('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n<tool', False).calls == [
        ToolCall("get_weather", "{}")]


@pytest.mark.parametrize("text,content,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}',
     "", [PARIS, UTC]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
    ('{"name": "get_weather", "parameters": {"ci', '{"name": "get_weather", "parameters": {"ci', []),
])
def test_llama3_json_reads_calls_as_the_text_grows(text, content, calls):
    final = _grow(LLAMA3.parse, text)
    assert (final.content, final.calls) == (content, calls)


@pytest.mark.parametrize("parser", [HERMES, LLAMA3], ids=["hermes", "llama3_json"])
def test_rendered_calls_parse_back(parser):
    assert parser.parse(parser.render_calls([PARIS, UTC]), True).calls == [PARIS, UTC]
    assert "get_weather" in parser.instructions([{"type": "function", "function": {"name": "get_weather"}}])


@pytest.mark.parametrize("starts_inside,text,split", [
    (False, "<think>\nIt is in France.\n</think>\n\nParis.", ("It is in France.", "Paris.")),
    (False, "Paris.", ("", "Paris.")),
    (False, "<think>cut off mid-thought", ("cut off mid-thought", "")),
    (False, "<b>bold</b>", ("", "<b>bold</b>")),
    (True, "It is in France.</think>Paris.", ("It is in France.", "Paris.")),
    (True, "<think>It is in France.</think>Paris.", ("It is in France.", "Paris.")),
])
def test_think_splits_reasoning_as_the_text_grows(starts_inside, text, split):
    parser = ThinkReasoningParser(ThinkConfig(starts_in_reasoning=starts_inside), None)
    prev = ("", "")
    for i in range(len(text) + 1):
        now = parser.split(text[:i], False)
        assert now[0].startswith(prev[0]) and now[1].startswith(prev[1]), (text[:i], prev, now)
        prev = now
    assert parser.split(text, True) == split


# --------------------------------------------------------------------------- plans


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _body(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


@pytest.mark.parametrize("fields,message", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type: only 'function' tools are supported, got 'retrieval'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function: required for a function tool"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name: must be 1-64"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name: 'get_weather' is given twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name: no tool named 'nope' in tools"),
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]},
     "tools[0].function.strict: enforced only with tool_choice 'required' or a named function"),
])
def test_a_bad_tool_or_choice_is_a_400_naming_the_field(fields, message):
    with pytest.raises(APIError) as e:
        plan_tools(_body(**fields), HERMES)
    assert e.value.status == 400 and e.value.message.startswith(message)


def test_auto_needs_a_tool_parser_but_required_and_named_do_not():
    with pytest.raises(APIError, match="tool_choice: 'auto' needs a tool parser in the server's pipeline"):
        plan_tools(_body(tools=[WEATHER]), None)
    assert plan_tools(_body(tools=[WEATHER], tool_choice="required"), None).mode == "required"


def test_required_and_named_choices_become_json_schemas():
    required = plan_tools(_body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), HERMES)
    schema = required.constraint().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}  # no parameters: any object
    named = plan_tools(_body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}), None)
    assert named.constraint().json == WEATHER["function"]["parameters"]
    assert plan_tools(_body(tools=[WEATHER], tool_choice="auto"), HERMES).constraint() is None


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}|{% endfor %}"
)


def _tokenizer(template: str) -> TokenizerBundle:
    from tokenizers import Tokenizer, models

    return TokenizerBundle(Tokenizer(models.WordLevel({"x": 0}, unk_token="x")), template)


def test_tools_go_through_a_template_that_takes_them_and_into_the_system_message_otherwise():
    messages = _body(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    ])
    plan = plan_tools(messages, HERMES)
    tok = _tokenizer(TOOLS_TEMPLATE)
    rendered, tools = render_messages(messages.messages, plan, HERMES, tok)
    assert tok.apply_chat_template(rendered, tools=tools) == (
        "TOOLS:get_weather\nuser: Weather?|assistant: [call get_weather Paris]|tool: 18C|")
    plain = _tokenizer("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    rendered, tools = render_messages(messages.messages, plan, HERMES, plain)
    assert tools is None and rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert HERMES.parse(rendered[2]["content"], True).calls == [PARIS]  # the earlier call, in the parser's format
    none = plan_tools(_body(tools=[WEATHER], tool_choice="none"), HERMES)
    assert render_messages(messages.messages, none, HERMES, plain)[0][0]["role"] == "user"  # none: no tools


def test_an_earlier_call_with_unreadable_arguments_is_a_400_naming_it():
    body = _body(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
    with pytest.raises(APIError, match=r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments: must be a JSON object"):
        render_messages(body.messages, None, HERMES, _tokenizer("x"))


# --------------------------------------------------------------------------- the reader


def _stream(reader: ChoiceReader, pieces: list[str]) -> tuple[str, dict[int, dict]]:
    """Feed ``pieces``; the streamed content and the tool calls reassembled as a client does."""
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        d = reader.feed(piece, final=i == len(pieces) - 1)
        content += d.content or ""
        for c in d.tool_calls or []:
            call = calls.setdefault(c.index, {"id": c.id, "name": c.function.name, "arguments": ""})
            call["arguments"] += c.function.arguments or ""
    return content, calls


def test_a_streamed_required_call_reassembles_to_the_whole_answer():
    plan = plan_tools(_body(tools=[WEATHER, TIME], tool_choice="required"), None)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    streamed = ChoiceReader(plan, None, None)
    content, calls = _stream(streamed, [text[i : i + 3] for i in range(0, len(text), 3)])
    whole = ChoiceReader(plan, None, None)
    whole.feed(text, True)
    msg = whole.message()
    assert content == "" and msg.content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert whole.finish_reason("stop") == "tool_calls"


def test_a_named_call_streams_its_arguments_token_by_token():
    plan = plan_tools(_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), None)
    reader = ChoiceReader(plan, None, None)
    content, calls = _stream(reader, ['{"city"', ': "Pa', 'ris"}'])
    assert content == "" and calls == {0: {"id": reader.calls[0].id, "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert reader.finish_reason("stop") == "stop"  # a named function ends with stop, as OpenAI's does


def test_auto_without_parallel_calls_keeps_the_first_and_reasoning_comes_first():
    plan = plan_tools(_body(tools=[WEATHER], parallel_tool_calls=False), HERMES)
    reader = ChoiceReader(plan, HERMES, ThinkReasoningParser(ThinkConfig(), None))
    text = ("<think>Need weather.</think>Checking.<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"
            "</tool_call><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}</tool_call>")
    content, calls = _stream(reader, [text[i : i + 5] for i in range(0, len(text), 5)])
    msg = reader.message()
    assert (content, msg.content, msg.reasoning_content) == ("Checking.", "Checking.", "Need weather.")
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": "Paris"}]
