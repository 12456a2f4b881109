"""``POST /v1/responses``: OpenAI's Responses API over the chat machinery.

A request becomes a chat request (``input`` items -> messages, ``instructions`` -> a system
message, ``text.format`` -> ``response_format``, flat function tools -> chat tools), so
templates, tool plans, constraints and parsers are the chat API's own; only the shape of
the answer differs: output items (``reasoning``, ``message``, ``function_call``) and, when
streamed, the Responses event types. Nothing is stored (``store: false``):
``previous_response_id`` is refused (``server/fields.py``).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from modserve.core.async_engine import RequestStream
from modserve.core.outputs import RequestOutput
from modserve.server.access_log import record
from modserve.server.body import decode_body
from modserve.server.chat import Admitted, admit, readers
from modserve.server.chat_output import ChoiceReader
from modserve.server.errors import APIError, bad_request, from_engine_error
from modserve.server.generation import abort_all, finals_or_none
from modserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    Delta,
    FunctionCallIn,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    ToolDef,
    encoder,
)
from modserve.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseTextConfig,
    ResponseUsage,
)
from modserve.server.state import ServerState
from modserve.server.tool_calls import arguments_object
from modserve.server.streaming import EventStream, event_json, iterate

# a chat field named in an error -> the Responses field it came from
_FIELD_NAMES = [
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function\."), r"\1."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^messages(\[\d+\])?"), "input"),  # message indices shift (instructions, merged calls): none given
]


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await decode_body(request, ResponsesRequest, state.limits.max_body_bytes, "responses")
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        admitted = await admit(request, state, to_chat(body), response_id, "responses")
    except APIError as e:
        raise _renamed(e) from None
    view = _View(body, state, response_id, admitted)
    streams = admitted.streams
    if body.stream:
        return EventStream(view.events(streams[0], request), on_close=lambda: abort_all(streams))
    finals = await finals_or_none(request, state, streams)
    if finals is None:
        return Response(status_code=499)
    response = view.finished(finals[0])
    record(request).output_tokens = response.usage.output_tokens
    return Response(encoder.encode(response), media_type="application/json")


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request means; 400 naming the Responses field."""
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise bad_request("input: must contain at least one item", "input")
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    fmt = body.text.format if body.text is not None else None
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("text.verbosity: not supported by this server: verbosity controls are not supported",
                          "text.verbosity", "unsupported_parameter")
    response_format = None
    if fmt is not None:
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema, description=fmt.description, strict=fmt.strict)
        response_format = ResponseFormat(type=fmt.type, json_schema=schema if fmt.type == "json_schema" else None)
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.type == "function" and not t.name:
                raise bad_request(f"tools[{i}].name: required for a function tool", f"tools[{i}].name")
            function = FunctionDef(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)
            tools.append(ToolDef(type=t.type, function=function if t.type == "function" else None))
    choice = body.tool_choice
    if not isinstance(choice, (str, type(None))):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return ChatCompletionRequest(
        messages=messages, model=body.model, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, stream=body.stream, response_format=response_format,
        tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls, user=body.user,
    )


def _add_item(messages: list[ChatMessage], item: Any, where: str) -> None:
    """One input item: a message, a function call the model made, or its output."""
    if not isinstance(item, dict):
        raise bad_request(f"{where}: must be an object (a message, function_call or function_call_output)", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"{where}.role: must be user, system, developer or assistant, got {role!r}", f"{where}.role")
        messages.append(ChatMessage(role="system" if role == "developer" else role,
                                    content=_item_text(item.get("content"), f"{where}.content")))
    elif kind == "function_call":
        arguments = _str(item, "arguments", where)
        arguments_object(arguments, f"{where}.arguments")  # named here: chat would name a shifted message
        call = ToolCallIn(id=_str(item, "call_id", where), function=FunctionCallIn(name=_str(item, "name", where), arguments=arguments))
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and last.tool_calls:  # parallel calls: one turn
            last.tool_calls.append(call)
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append(ChatMessage(role="tool", tool_call_id=_str(item, "call_id", where),
                                    content=output if isinstance(output, str) else _item_text(output, f"{where}.output")))
    else:
        raise bad_request(
            f"{where}.type: only message, function_call and function_call_output items are supported, got {kind!r}",
            f"{where}.type",
        )


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: required, a string", f"{where}.{key}")
    return value


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts are supported, got type {kind!r}", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _renamed(e: APIError) -> APIError:
    """A chat field in an error, renamed to the Responses field the client sent."""
    head, sep, rest = e.message.partition(": ")
    param = e.param
    for pattern, name in _FIELD_NAMES:
        head = pattern.sub(name, head) if sep else head
        param = pattern.sub(name, param) if param is not None else None
    return APIError(e.status, head + sep + rest, param, e.code, e.headers)


class _View:
    """Renders the engine's output for one Responses request, whole or as events."""

    def __init__(self, body: ResponsesRequest, state: ServerState, response_id: str, admitted: Admitted) -> None:
        self.body = body
        self.state = state
        self.id = response_id
        self.created = int(time.time())
        self.prompt_tokens = admitted.prompt_tokens
        self.reader: ChoiceReader = readers(state, admitted, 1)[0]
        self.items: list[OutputItem] = []

    def response(self, status: str, usage: ResponseUsage | None = None, incomplete: bool = False) -> ResponseObject:
        b = self.body
        return ResponseObject(
            id=self.id, created_at=self.created, model=self.state.model_name, status=status, output=list(self.items),
            instructions=b.instructions, max_output_tokens=b.max_output_tokens, temperature=b.temperature,
            top_p=b.top_p, parallel_tool_calls=b.parallel_tool_calls,
            tool_choice=b.tool_choice if b.tool_choice is not None else ("auto" if b.tools else "none"),
            tools=b.tools or [], text=b.text or ResponseTextConfig(), metadata=b.metadata or {}, usage=usage,
            incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None, user=b.user,
        )

    def usage(self, out: RequestOutput) -> ResponseUsage:
        generated = len(out.outputs[0].token_ids)
        thinking = self.reader.sent_reasoning
        reasoning = len(self.state.engine.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
        return ResponseUsage(
            self.prompt_tokens, InputTokensDetails(out.num_cached_tokens), generated,
            OutputTokensDetails(min(reasoning, generated)), self.prompt_tokens + generated,
        )

    def finished(self, final: RequestOutput) -> ResponseObject:
        c = final.outputs[0]
        self.reader.feed(c.text, final=True)
        msg = self.reader.message()
        status = "incomplete" if c.finish_reason == "length" else "completed"
        if isinstance(msg.reasoning_content, str):
            self.items.append(OutputItem("reasoning", _id("rs"), status, content=[ReasoningText(msg.reasoning_content)],
                                         summary=[]))
        if msg.content is not None and (msg.content or not self.items):
            self.items.append(OutputItem("message", _id("msg"), status, role="assistant", content=[OutputText(msg.content)]))
        for call in self.reader.calls:
            self.items.append(OutputItem("function_call", _id("fc"), status, call_id=call.id,
                                         name=call.function.name, arguments=call.function.arguments))
        return self.response(status, self.usage(final), status == "incomplete")

    async def events(self, stream: RequestStream, request: Request) -> AsyncIterator[bytes]:
        events = _Events(self)
        yield events.emit("response.created", response=self.response("in_progress"))
        yield events.emit("response.in_progress", response=self.response("in_progress"))
        generated = 0
        try:
            async for _, out in iterate([stream], self.state.limits.request_timeout_s):
                c = out.outputs[0]
                generated += len(c.token_ids_delta)
                for event in events.delta(self.reader.feed(c.text_delta, c.finished)):
                    yield event
                if c.finished:
                    status = "incomplete" if c.finish_reason == "length" else "completed"
                    if not self.items and events.open is None:  # an empty answer is still a message
                        for event in events.delta(Delta(content="")):
                            yield event
                    for event in events.close(status):
                        yield event
                    kind = "response.incomplete" if status == "incomplete" else "response.completed"
                    yield events.emit(kind, response=self.response(status, self.usage(out), status == "incomplete"))
        except Exception as e:
            err = from_engine_error(e)
            yield events.emit("error", message=err.message, code=err.code, param=err.param)
        finally:
            record(request).output_tokens = generated


class _Events:
    """The Responses event sequence: an output item is opened (``output_item.added``), grows
    (text, reasoning or argument deltas) and is closed (``...done``) before the next opens."""

    def __init__(self, view: _View) -> None:
        self.view = view
        self.seq = 0
        self.open: OutputItem | None = None
        self.text = ""

    def emit(self, kind: str, **fields: Any) -> bytes:
        event = ResponseEvent(kind, self.seq, **fields)
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + event_json(event) + b"\n\n"

    def delta(self, d: Delta) -> Iterator[bytes]:
        if d.reasoning_content:
            yield from self._grow("reasoning", d.reasoning_content)
        if d.content is not None:
            yield from self._grow("message", d.content)
        for call in d.tool_calls or []:
            if call.id is not None:  # a new call
                yield from self.close("completed")
                yield from self._start(OutputItem("function_call", _id("fc"), "in_progress", call_id=call.id,
                                                  name=call.function.name, arguments=""))
            if call.function is not None and call.function.arguments:
                yield from self._grow("function_call", call.function.arguments)

    def _start(self, item: OutputItem) -> Iterator[bytes]:
        self.open, self.text = item, ""
        yield self.emit("response.output_item.added", output_index=len(self.view.items), item=item)
        if item.type == "message":
            yield self._part("response.content_part.added", "")

    def _part(self, kind: str, text: str) -> bytes:
        return self.emit(kind, item_id=self.open.id, output_index=len(self.view.items), content_index=0,
                         part=OutputText(text))

    def _grow(self, kind: str, text: str) -> Iterator[bytes]:
        if self.open is None or self.open.type != kind:
            yield from self.close("completed")
            role = "assistant" if kind == "message" else None
            yield from self._start(OutputItem(kind, _id("rs" if kind == "reasoning" else "msg"), "in_progress",
                                              role=role, content=[], summary=[] if kind == "reasoning" else None))
        self.text += text
        where = {"item_id": self.open.id, "output_index": len(self.view.items)}
        if kind == "message":
            yield self.emit("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])
        elif kind == "reasoning":
            yield self.emit("response.reasoning_text.delta", **where, content_index=0, delta=text)
        else:
            yield self.emit("response.function_call_arguments.delta", **where, delta=text)

    def close(self, status: str) -> Iterator[bytes]:
        """Finish the open item (``status`` ``incomplete`` when the output was cut off)."""
        item = self.open
        if item is None:
            return
        where = {"item_id": item.id, "output_index": len(self.view.items)}
        item.status = status
        if item.type == "message":
            item.content = [OutputText(self.text)]
            yield self.emit("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[])
            yield self._part("response.content_part.done", self.text)
        elif item.type == "reasoning":
            item.content = [ReasoningText(self.text)]
            yield self.emit("response.reasoning_text.done", **where, content_index=0, text=self.text)
        else:
            item.arguments = self.text
            yield self.emit("response.function_call_arguments.done", **where, arguments=self.text)
        yield self.emit("response.output_item.done", output_index=len(self.view.items), item=item)
        self.view.items.append(item)
        self.open = None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
