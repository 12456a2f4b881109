"""``POST /v1/chat/completions``: messages through the model's chat template.

A stream opens with one chunk per choice carrying ``role: assistant``; text follows as
``delta.content``; the chunk that ends a choice carries its ``finish_reason``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from modserve.core.async_engine import RequestStream
from modserve.core.outputs import CompletionOutput
from modserve.core.server.access_log import record
from modserve.core.server.body import decode_body
from modserve.core.server.errors import bad_request, from_engine_error
from modserve.core.server.generation import Prompt, abort_all, start
from modserve.core.server.logprobs import chat_logprobs
from modserve.core.server.params import fit_to_prompt, sampling_params
from modserve.core.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    Delta,
    Usage,
    encoder,
)
from modserve.core.server.state import ServerState
from modserve.core.server.streaming import DONE, ClientDisconnected, EventStream, collect, iterate, sse, unless_disconnected
from modserve.core.tokenizer import ChatTemplateError


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await decode_body(request, ChatCompletionRequest, state.config.max_body_bytes)
    state.check_model(body.model)
    prompt = Prompt(encode_messages(body.messages, body.add_generation_prompt, state), None)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    top_n = body.top_logprobs or 0
    params = sampling_params(
        body, state, max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=top_n if body.logprobs else None, logprobs_param="top_logprobs",
    )
    params = fit_to_prompt(params, prompt.token_ids, state, "messages")
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = start(request, state, response_id, "chat", [prompt], [params], priority=body.priority, user=body.user)
    view = _View(body, state, response_id, len(prompt.token_ids))
    if body.stream:
        return EventStream(view.events(streams[0], request), on_close=lambda: abort_all(streams))
    try:
        (final,) = await unless_disconnected(request, collect(streams, state.config.request_timeout_s))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise from_engine_error(e) from None
    finally:
        abort_all(streams)
    choices = [ChatChoice(c.index, AssistantMessage(c.text), view.logprobs(c, c.logprobs), c.finish_reason, c.stop_reason) for c in final.outputs]
    usage = view.usage(sum(len(c.token_ids) for c in final.outputs))
    record(request).output_tokens = usage.completion_tokens
    completion = ChatCompletion(response_id, view.created, state.model_name, choices, usage)
    return Response(encoder.encode(completion), media_type="application/json")


def encode_messages(messages: list[ChatMessage], add_generation_prompt: bool, state: ServerState) -> list[int]:
    """Render through the chat template (text content only); 400 for what cannot be rendered."""
    if not messages:
        raise bad_request("messages: must contain at least one message", "messages")
    if len(messages) > state.config.max_messages:
        raise bad_request(f"messages: at most {state.config.max_messages} messages (server.max_messages)", "messages")
    rendered: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg = {"role": m.role, "content": _text(m.content, f"messages[{i}].content")}
        if m.name is not None:
            msg["name"] = m.name
        rendered.append(msg)
    try:
        return state.engine.tokenizer.encode_chat(rendered, add_generation_prompt)
    except ChatTemplateError as e:
        raise bad_request(f"messages: {e}", "messages") from None


def _text(content: str | list | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"{where}[{j}]: only text content parts are supported, got type {part.type!r}", where)
    return "".join(part.text for part in content)


class _View:
    def __init__(self, body: ChatCompletionRequest, state: ServerState, response_id: str, prompt_tokens: int) -> None:
        self.body = body
        self.state = state
        self.id = response_id
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens

    def logprobs(self, c: CompletionOutput, entries: list | None) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        ids = c.token_ids[len(c.token_ids) - len(entries) :] if entries else []
        return chat_logprobs(entries or [], ids, self.body.top_logprobs or 0, self.state.engine.tokenizer.token_text)

    def usage(self, generated: int) -> Usage:
        return Usage(self.prompt_tokens, generated, self.prompt_tokens + generated)

    def chunk(self, choices: list[ChatChunkChoice], usage: Any) -> bytes:
        return sse(ChatCompletionChunk(self.id, self.created, self.state.model_name, choices, usage=usage))

    async def events(self, stream: RequestStream, request: Request) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        usage = None if include_usage else UNSET
        generated = 0
        try:
            yield self.chunk([ChatChunkChoice(i, Delta(role="assistant", content="")) for i in range(self.body.n)], usage)
            async for _, out in iterate([stream], self.state.config.request_timeout_s):
                choices = []
                for c in out.outputs:
                    entries = c.logprobs[len(c.logprobs) - len(c.token_ids_delta) :] if c.logprobs else []
                    if not (c.text_delta or c.finished or entries):
                        continue
                    delta = Delta(content=c.text_delta) if c.text_delta else Delta()
                    choices.append(ChatChunkChoice(c.index, delta, self.logprobs(c, entries), c.finish_reason))
                    generated += len(c.token_ids) if c.finished else 0
                if choices:
                    yield self.chunk(choices, usage)
            if include_usage:
                yield self.chunk([], self.usage(generated))
        except Exception as e:
            yield sse(from_engine_error(e).body())
        finally:
            record(request).output_tokens = generated
        yield DONE
