"""``POST /v1/chat/completions``: messages through the model's chat template.

A stream opens, with the first generated token, with one chunk per choice carrying
``role: assistant``; text follows as ``delta.content`` (``delta.reasoning_content`` and
``delta.tool_calls`` with the pipeline's parsers and a request's tools); the chunk that ends
a choice carries its ``finish_reason``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from collections.abc import AsyncIterator
from typing import Any

from msgspec import UNSET
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from modserve.core.async_engine import RequestStream
from modserve.core.outputs import CompletionOutput, RequestOutput
from modserve.server.access_log import record
from modserve.server.body import decode_body
from modserve.server.errors import APIError, bad_request, from_engine_error
from modserve.server.generation import Prompt, abort_all, finals_or_none, start
from modserve.server.chat_output import ChoiceReader
from modserve.server.logprobs import chat_logprobs, prompt_logprob_rows
from modserve.server.params import fit_to_prompt, sampling_params
from modserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    Delta,
    PromptTokensDetails,
    Usage,
    encoder,
)
from modserve.server.state import ServerState
from modserve.server.tool_calls import ToolPlan, plan_tools, render_messages
from modserve.server.streaming import (
    DONE,
    EventStream,
    iterate,
    sse,
)
from modserve.core.tokenizer import ChatTemplateError


async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await decode_body(request, ChatCompletionRequest, state.limits.max_body_bytes, "chat")
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    admitted = await admit(request, state, body, response_id, "chat")
    streams = admitted.streams
    view = _View(body, state, response_id, admitted)
    if body.stream:
        return EventStream(view.events(streams[0], request), on_close=lambda: abort_all(streams))
    finals = await finals_or_none(request, state, streams)
    if finals is None:
        return Response(status_code=499)
    completion = view.response(finals[0])
    rec = record(request)
    rec.output_tokens = completion.usage.completion_tokens
    if state.config.log_prompts:
        rec.output = [c.message.content for c in completion.choices]
    return Response(encoder.encode(completion), media_type="application/json")


@dataclass
class Admitted:
    """A chat request in the engine: its stream, and what reading its output needs."""

    streams: list[RequestStream]
    prompt_tokens: int
    plan: ToolPlan | None
    constrained: bool  # the output is decoded under a grammar


async def admit(request: Request, state: ServerState, body: ChatCompletionRequest, response_id: str, operation: str) -> Admitted:
    """Messages and tools -> prompt, sampling params -> the engine (every check first)."""
    state.check_model(body.model)
    plan = plan_tools(body, state.engine.tool_parser)
    token_ids = await run_in_threadpool(
        encode_messages, body.messages, body.add_generation_prompt, state, plan, body.chat_template_kwargs
    )
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    params = sampling_params(
        body, state, max_tokens=body.max_completion_tokens or body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, logprobs_param="top_logprobs",
        prompt_logprobs=body.prompt_logprobs, tool_constraint=plan.constraint() if plan is not None else None,
    )
    try:
        params = fit_to_prompt(params, token_ids, state, "messages")
    except APIError as e:
        if plan is None or plan.constraint() is None or not (e.param or "").startswith("structured_outputs"):
            raise
        raise bad_request(  # the grammar came from the tools' schemas, not from a structured_outputs field
            f"tools: a function's parameters are not a JSON schema this server can decode under: {e.message.split(': ', 1)[-1]}",
            "tools",
        ) from None
    streams = start(request, state, response_id, operation, [Prompt(token_ids, None)], [params], body)
    return Admitted(streams, len(token_ids), plan, params.structured_outputs is not None)


def readers(state: ServerState, admitted: Admitted, n: int) -> list[ChoiceReader]:
    """One output reader per choice; a grammar-constrained output has no thinking to split off."""
    reasoning = None if admitted.constrained else state.engine.reasoning_parser
    return [ChoiceReader(admitted.plan, state.engine.tool_parser, reasoning) for _ in range(n)]


_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def encode_messages(
    messages: list[ChatMessage], add_generation_prompt: bool, state: ServerState,
    plan: ToolPlan | None = None, template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render through the chat template (text content only); 400 for what cannot be rendered.

    Runs in a worker thread (a long conversation must not stall the event loop)."""
    if not messages:
        raise bad_request("messages: must contain at least one message", "messages")
    if len(messages) > state.limits.max_messages:
        raise bad_request(f"messages: at most {state.limits.max_messages} messages (server.max_messages)", "messages")
    clash = next((k for k in template_kwargs or {} if k in _RESERVED_TEMPLATE_VARIABLES), None)
    if clash is not None:
        raise bad_request(
            f"chat_template_kwargs.{clash}: set by the server; give it as a request field instead", "chat_template_kwargs"
        )
    tokenizer = state.engine.tokenizer
    rendered, tools = render_messages(messages, plan, state.engine.tool_parser, tokenizer)
    try:
        return tokenizer.encode_chat(rendered, add_generation_prompt, tools, **(template_kwargs or {}))
    except ChatTemplateError as e:
        raise bad_request(f"messages: {e}", "messages") from None


class _View:
    """Renders engine outputs for one chat request, streamed or whole."""

    def __init__(self, body: ChatCompletionRequest, state: ServerState, response_id: str, admitted: Admitted) -> None:
        self.body = body
        self.state = state
        self.id = response_id
        self.created = int(time.time())
        self.prompt_tokens = admitted.prompt_tokens
        self.readers = readers(state, admitted, body.n)

    def logprobs(self, c: CompletionOutput, delta: bool) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        token_ids = c.token_ids_delta if delta else c.token_ids
        entries = c.logprobs[len(c.logprobs) - len(token_ids) :] if token_ids else []
        return chat_logprobs(entries, token_ids, self.body.top_logprobs or 0, self.state.engine.tokenizer.token_text)

    def usage(self, generated: int, cached: int) -> Usage:
        return Usage(self.prompt_tokens, generated, self.prompt_tokens + generated, PromptTokensDetails(cached))

    def prompt_logprobs(self, out: RequestOutput):
        return UNSET if self.body.prompt_logprobs is None else prompt_logprob_rows(out, self.body.prompt_logprobs)

    def response(self, final: RequestOutput) -> ChatCompletion:
        choices = []
        for c in final.outputs:
            reader = self.readers[c.index]
            reader.feed(c.text, final=True)
            choices.append(ChatChoice(
                c.index, reader.message(), self.logprobs(c, False), reader.finish_reason(c.finish_reason), c.stop_reason
            ))
        usage = self.usage(sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens)
        completion = ChatCompletion(self.id, self.created, self.state.model_name, choices, usage)
        completion.prompt_logprobs = self.prompt_logprobs(final)
        return completion

    def chunk(self, choices: list[ChatChunkChoice], usage: Any, prompt_logprobs: Any = UNSET) -> bytes:
        return sse(ChatCompletionChunk(
            self.id, self.created, self.state.model_name, choices, usage=usage, prompt_logprobs=prompt_logprobs
        ))

    async def events(self, stream: RequestStream, request: Request) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        continuous = include_usage and self.body.stream_options.continuous_usage_stats
        usage = None if include_usage else UNSET
        generated = cached = 0
        texts: dict[int, str] | None = {} if self.state.config.log_prompts else None
        roles = [ChatChunkChoice(i, Delta(role="assistant", content="")) for i in range(self.body.n)]
        try:
            async for _, out in iterate([stream], self.state.limits.request_timeout_s):
                if roles:  # with the first token, as vLLM sends it: a client's TTFT is the model's
                    yield self.chunk(roles, usage, self.prompt_logprobs(out))
                    roles = []
                cached = max(cached, out.num_cached_tokens)
                choices = []
                for c in out.outputs:
                    generated += len(c.token_ids_delta)
                    reader = self.readers[c.index]
                    delta = reader.feed(c.text_delta, c.finished)
                    shown = delta.content or delta.reasoning_content or delta.tool_calls
                    if not (shown or c.finished or (self.body.logprobs and c.token_ids_delta)):
                        continue  # nothing to show yet (text held back for a stop string or a parser)
                    if texts is not None:
                        texts[c.index] = texts.get(c.index, "") + c.text_delta
                    choices.append(ChatChunkChoice(
                        c.index, delta, self.logprobs(c, True), reader.finish_reason(c.finish_reason)
                    ))
                if choices:
                    yield self.chunk(choices, self.usage(generated, cached) if continuous else usage)
            if include_usage:
                yield self.chunk([], self.usage(generated, cached))
        except Exception as e:
            yield sse(from_engine_error(e).body())
        finally:
            rec = record(request)
            rec.output_tokens = generated
            if texts is not None:
                rec.output = [texts[k] for k in sorted(texts)]
        yield DONE
