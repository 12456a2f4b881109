"""``POST /v1/completions``: text or token-id prompts, batches, ``echo`` with prompt logprobs.

Everything lm-evaluation-harness's ``local-completions`` sends works: a batch of
token-id lists, ``echo=true`` with ``logprobs`` (the prompt tokens' logprobs, the first
null) and ``max_tokens=1``. Choice ``i * n + j`` is sample ``j`` of prompt ``i``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from modserve.core.async_engine import RequestStream
from modserve.core.outputs import CompletionOutput, RequestOutput
from modserve.core.server.access_log import record
from modserve.core.server.body import decode_body
from modserve.core.server.errors import bad_request, from_engine_error
from modserve.core.server.generation import Prompt, abort_all, start
from modserve.core.server.logprobs import completion_logprobs
from modserve.core.server.params import fit_to_prompt, sampling_params
from modserve.core.server.protocol import Completion, CompletionChoice, CompletionRequest, Usage, encoder
from modserve.core.server.state import ServerState
from modserve.core.server.streaming import DONE, ClientDisconnected, EventStream, collect, iterate, sse, unless_disconnected


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await decode_body(request, CompletionRequest, state.config.max_body_bytes)
    state.check_model(body.model)
    prompts = _prompts(body.prompt, state)
    logprobs = body.logprobs
    params = sampling_params(
        body, state, max_tokens=body.max_tokens, logprobs=logprobs, logprobs_param="logprobs",
        prompt_logprobs=logprobs if body.echo and logprobs is not None else None,
    )
    per_prompt = [fit_to_prompt(params, p.token_ids, state, "prompt") for p in prompts]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    streams = start(request, state, response_id, "text_completion", prompts, per_prompt, priority=body.priority, user=body.user)
    view = _View(body, state, response_id, prompts)
    if body.stream:
        return EventStream(view.events(streams, request), on_close=lambda: abort_all(streams))
    try:
        finals = await unless_disconnected(request, collect(streams, state.config.request_timeout_s))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        raise from_engine_error(e) from None
    finally:
        abort_all(streams)
    completion = view.response(finals)
    record(request).output_tokens = completion.usage.completion_tokens
    return Response(encoder.encode(completion), media_type="application/json")


def _prompts(prompt: str | list, state: ServerState) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    tok = state.engine.tokenizer
    if isinstance(prompt, str):
        return [Prompt(tok.encode(prompt), prompt)]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [Prompt(tok.encode(p), p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [Prompt(list(prompt), None)]
    if all(isinstance(p, list) for p in prompt):
        return [Prompt(p, None) for p in prompt]
    raise bad_request(
        "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt"
    )


class _View:
    """Renders engine outputs for one completions request, streamed or whole."""

    def __init__(self, body: CompletionRequest, state: ServerState, response_id: str, prompts: list[Prompt]) -> None:
        self.body = body
        self.state = state
        self.id = response_id
        self.created = int(time.time())
        self.prompts = prompts
        self.token_text = state.engine.tokenizer.token_text

    def prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        return p.text if p.text is not None else self.state.engine.tokenizer.decode(p.token_ids, skip_special_tokens=False)

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput, text: str, token_ids: list[int], entries, first: bool, offset: int) -> CompletionChoice:
        """``first``: this is the choice's first piece of text, where ``echo`` puts the prompt."""
        if self.body.echo and first:
            text = self.prompt_text(i) + text
            token_ids = self.prompts[i].token_ids + token_ids
            entries = (out.prompt_logprobs or [None] * len(self.prompts[i].token_ids)) + entries
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(entries, token_ids, self.token_text, offset)
        return CompletionChoice(i * self.body.n + c.index, text, logprobs, c.finish_reason, c.stop_reason)

    def response(self, finals: list[RequestOutput]) -> Completion:
        choices = [
            self.choice(i, out, c, c.text, c.token_ids, c.logprobs or [], True, 0)
            for i, out in enumerate(finals)
            for c in out.outputs
        ]
        return Completion(self.id, self.created, self.state.model_name, choices, usage=self.usage(finals))

    def usage(self, finals: list[RequestOutput]) -> Usage:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        generated = sum(len(c.token_ids) for out in finals for c in out.outputs)
        return Usage(prompt, generated, prompt + generated)

    async def events(self, streams: list[RequestStream], request: Request) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        usage = None if include_usage else UNSET
        sent: dict[int, int] = {}  # choice -> characters of logprob tokens sent so far
        generated = 0
        try:
            async for i, out in iterate(streams, self.state.config.request_timeout_s):
                for c in out.outputs:
                    key = i * self.body.n + c.index
                    first = key not in sent
                    entries = c.logprobs[len(c.logprobs) - len(c.token_ids_delta) :] if c.logprobs else []
                    if not (c.text_delta or c.finished or entries or (first and self.body.echo)):
                        continue
                    offset = sent.get(key, 0)
                    choice = self.choice(i, out, c, c.text_delta, c.token_ids_delta, entries, first, offset)
                    sent[key] = offset + (sum(len(t) for t in choice.logprobs.tokens) if choice.logprobs else 0)
                    generated += len(c.token_ids) if c.finished else 0
                    yield sse(Completion(self.id, self.created, self.state.model_name, [choice], usage=usage))
            if include_usage:
                prompt = sum(len(p.token_ids) for p in self.prompts)
                yield sse(Completion(self.id, self.created, self.state.model_name, [], usage=Usage(prompt, generated, prompt + generated)))
        except Exception as e:
            yield sse(from_engine_error(e).body())
        finally:
            record(request).output_tokens = generated
        yield DONE
