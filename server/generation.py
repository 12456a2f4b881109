"""Admission shared by completions and chat: one engine request per prompt, traced and logged."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from modserve.core.async_engine import RequestStream
from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams
from modserve.server.access_log import record
from modserve.server.errors import bad_request, from_engine_error
from modserve.server.protocol import SamplingFields
from modserve.server.state import ServerState
from modserve.server.streaming import ClientDisconnected, collect, unless_disconnected


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
    body: SamplingFields,
) -> list[RequestStream]:
    """Submit every prompt or none (503 when the waiting queue cannot take them all now;
    400 when it never could: more sequences than ``server.max_waiting_requests``)."""
    n = params[0].n
    rec = record(request)
    rec.request_id, rec.prompt_tokens = response_id, sum(len(p.token_ids) for p in prompts)
    if state.config.log_prompts:
        rec.prompt = [p.text if p.text is not None else p.token_ids for p in prompts]
    if body.cache_salt is not None and not body.cache_salt:
        raise bad_request("cache_salt: must be a non-empty string when given", "cache_salt")
    num_seqs, limit = len(prompts) * n, state.engine.max_waiting_requests
    if num_seqs > limit:
        param = "prompt" if len(prompts) > 1 else "n"
        raise bad_request(
            f"{param}: {len(prompts)} prompt(s) x n={n} make {num_seqs} sequences, more than the server ever "
            f"queues ({limit}, server.max_waiting_requests); split the request",
            param,
            "batch_too_large",
        )
    picks = [state.pick_replica(p.token_ids, body.cache_salt) for p in prompts]
    if len(state.replicas) > 1:
        request.scope.setdefault("state", {})["replicas"] = picks  # the x-modserve-replica header
    for idx in sorted(set(picks)):
        try:
            state.replicas[idx].check_capacity(picks.count(idx) * n)
        except Exception as e:
            err = from_engine_error(e)
            state.replicas[idx].engine.notify("on_request_rejected", reason=err.code or "unknown")
            raise err from None
    streams = []
    for i, (prompt, sp, idx) in enumerate(zip(prompts, params, picks)):
        rid = response_id if len(prompts) == 1 else f"{response_id}-{i}"
        state.replicas[idx].engine.notify(
            "on_request_received", request_id=rid, headers=dict(request.headers), operation=operation, response_id=response_id
        )
        streams.append(
            state.replicas[idx].generate(
                prompt.token_ids, sp, rid, priority=body.priority, cache_salt=body.cache_salt, user=body.user,
                prompt=prompt.text, validated=True,  # by fit_to_prompt, for every prompt before any was admitted
            )
        )
    return streams


def abort_all(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def finals_or_none(request: Request, state: ServerState, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """Every stream's final output for a non-streamed answer; None when the client left first
    (the handler answers 499). The streams are aborted either way; an engine failure is its API error."""
    try:
        return await unless_disconnected(request, collect(streams, state.limits.request_timeout_s))
    except ClientDisconnected:
        return None
    except Exception as e:
        raise from_engine_error(e) from None
    finally:
        abort_all(streams)
