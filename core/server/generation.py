"""Admission shared by completions and chat: one engine request per prompt, traced and logged."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from modserve.core import parallel_sampling
from modserve.core.async_engine import RequestStream
from modserve.core.sampling_params import SamplingParams
from modserve.core.server.access_log import record
from modserve.core.server.errors import from_engine_error
from modserve.core.server.state import ServerState


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as given, when it was text


def start(
    request: Request,
    state: ServerState,
    response_id: str,
    operation: str,
    prompts: list[Prompt],
    params: list[SamplingParams],
    *,
    priority: int,
    user: str | None,
) -> list[RequestStream]:
    """Submit every prompt or none (503 when the waiting queue cannot take them all)."""
    n = params[0].n
    rec = record(request)
    rec.request_id, rec.prompt_tokens = response_id, sum(len(p.token_ids) for p in prompts)
    if state.config.log_prompts:
        rec.prompt = [p.text if p.text is not None else p.token_ids for p in prompts]
    try:
        state.engine.check_capacity(len(prompts) * n)
    except Exception as e:
        raise from_engine_error(e) from None
    streams = []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        rid = response_id if len(prompts) == 1 else f"{response_id}-{i}"
        if state.tracing is not None:
            ids = [parallel_sampling.child_id(rid, j, n) for j in range(n)]
            state.tracing.attach(ids, request.headers, operation, response_id)
        streams.append(
            state.engine.generate(prompt.token_ids, sp, rid, priority=priority, user=user, prompt=prompt.text)
        )
    return streams


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()
