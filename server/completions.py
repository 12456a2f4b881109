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
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from modserve.core.async_engine import RequestStream
from modserve.core.outputs import CompletionOutput, RequestOutput
from modserve.server.access_log import record
from modserve.server.body import decode_body
from modserve.server.errors import bad_request, from_engine_error
from modserve.server.generation import Prompt, abort_all, finals_or_none, start
from modserve.server.logprobs import completion_logprobs, prompt_logprob_rows
from modserve.server.params import fit_to_prompt, sampling_params
from modserve.server.protocol import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
    encoder,
)
from modserve.server.state import ServerState
from modserve.server.streaming import (
    DONE,
    EventStream,
    iterate,
    sse,
)


async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await decode_body(request, CompletionRequest, state.limits.max_body_bytes, "completions")
    state.check_model(body.model)
    prompts = await run_in_threadpool(_prompts, body.prompt, state)  # a long prompt must not stall the event loop
    params = sampling_params(
        body, state, max_tokens=body.max_tokens, logprobs=body.logprobs, logprobs_param="logprobs",
        prompt_logprobs=_prompt_logprobs(body),
    )
    per_prompt = [fit_to_prompt(params, p.token_ids, state, "prompt") for p in prompts]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    streams = start(request, state, response_id, "text_completion", prompts, per_prompt, body)
    view = _View(body, state, response_id, prompts)
    if body.stream:
        return EventStream(view.events(streams, request), on_close=lambda: abort_all(streams))
    finals = await finals_or_none(request, state, streams)
    if finals is None:
        return Response(status_code=499)
    completion = view.response(finals)
    rec = record(request)
    rec.output_tokens = completion.usage.completion_tokens
    if state.config.log_prompts:
        rec.output = [c.text for c in completion.choices]
    return Response(encoder.encode(completion), media_type="application/json")


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """Prompt logprobs the engine computes: ``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs``."""
    wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
    return max(wanted) if wanted else None


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
        self.tokenizer = state.engine.tokenizer

    def completion(self, choices: list[CompletionChoice], usage=UNSET) -> Completion:
        return Completion(self.id, self.created, self.state.model_name, choices, usage=usage)

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput, delta: bool, first: bool = True, offset: int = 0):
        """Choice ``c`` of prompt ``i``: its whole text or this step's ``delta``.

        ``first``: the choice's first piece of text, where ``echo`` puts the prompt;
        ``offset``: where the piece starts, for ``logprobs.text_offset``."""
        text, token_ids = (c.text_delta, c.token_ids_delta) if delta else (c.text, c.token_ids)
        entries = c.logprobs[len(c.logprobs) - len(token_ids) :] if c.logprobs else []
        if self.body.echo and first:
            prompt = self.prompts[i]
            text = (prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids, False)) + text
            token_ids = prompt.token_ids + token_ids
            entries = (out.prompt_logprobs or [None] * len(prompt.token_ids)) + entries
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(entries, token_ids, self.tokenizer.token_text, offset)
        choice = CompletionChoice(i * self.body.n + c.index, text, logprobs, c.finish_reason, c.stop_reason)
        if self.body.prompt_logprobs is not None and first:
            choice.prompt_logprobs = prompt_logprob_rows(out, self.body.prompt_logprobs)
        return choice

    def usage(self, generated: int, cached: int) -> Usage:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        return Usage(prompt, generated, prompt + generated, PromptTokensDetails(cached))

    def response(self, finals: list[RequestOutput]) -> Completion:
        choices = [self.choice(i, out, c, delta=False) for i, out in enumerate(finals) for c in out.outputs]
        generated = sum(len(c.token_ids) for out in finals for c in out.outputs)
        return self.completion(choices, self.usage(generated, sum(out.num_cached_tokens for out in finals)))

    async def events(self, streams: list[RequestStream], request: Request) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        continuous = include_usage and self.body.stream_options.continuous_usage_stats
        sent: dict[int, int] = {}  # choice -> characters of logprob tokens sent so far
        generated = 0
        cached: dict[int, int] = {}  # prompt -> its prefix-cache hit (known from its first output on)
        texts: dict[int, str] | None = {} if self.state.config.log_prompts else None
        try:
            async for i, out in iterate(streams, self.state.limits.request_timeout_s):
                cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
                for c in out.outputs:
                    generated += len(c.token_ids_delta)
                    key = i * self.body.n + c.index
                    first = key not in sent
                    has_logprobs = self.body.logprobs is not None and c.token_ids_delta
                    if not (c.text_delta or c.finished or has_logprobs or (first and self.body.echo)):
                        continue  # nothing to show yet (text held back for a possible stop string)
                    choice = self.choice(i, out, c, delta=True, first=first, offset=sent.get(key, 0))
                    sent[key] = sent.get(key, 0) + (sum(map(len, choice.logprobs.tokens)) if choice.logprobs else 0)
                    if texts is not None:
                        texts[key] = texts.get(key, "") + choice.text
                    usage = self.usage(generated, sum(cached.values())) if continuous else (None if include_usage else UNSET)
                    yield sse(self.completion([choice], usage))
            if include_usage:
                yield sse(self.completion([], self.usage(generated, sum(cached.values()))))
        except Exception as e:
            yield sse(from_engine_error(e).body())
        finally:
            rec = record(request)
            rec.output_tokens = generated
            if texts is not None:
                rec.output = [texts[k] for k in sorted(texts)]
        yield DONE
