"""The small endpoints: models, health, metrics, tokenize, detokenize; and the route table."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from modserve.server.body import decode_body
from modserve.server.chat import create_chat_completion, encode_messages
from modserve.server.completions import create_completion
from modserve.server.responses import create_response
from modserve.server.errors import APIError, bad_request
from modserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    encoder,
)
from modserve.server.state import ServerState
from modserve.server.exposition import render


def _json(obj) -> Response:
    return Response(encoder.encode(obj), media_type="application/json")


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def list_models(request: Request) -> Response:
    s = _state(request)
    return _json(ModelList([ModelCard(s.model_name, s.created, s.engine.max_model_len)]))


async def retrieve_model(request: Request) -> Response:
    """``GET /v1/models/{id}``: the served model's card, 404 for any other id."""
    s = _state(request)
    s.check_model(request.path_params["model_id"])
    return _json(ModelCard(s.model_name, s.created, s.engine.max_model_len))


async def tokenizer_info(request: Request) -> Response:
    s = _state(request)
    tok = s.engine.tokenizer
    eos_ids = tok.eos_token_ids
    return _json(TokenizerInfo(
        tokenizer_class="PreTrainedTokenizerFast",
        vocab_size=s.engine.vocab_size,
        model_max_length=s.engine.max_model_len,
        chat_template=tok.chat_template,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        eos_token_id=eos_ids[0] if eos_ids else None,
    ))


async def health(request: Request) -> Response:
    """200 while serving; 503 once draining for shutdown or when an engine loop (any replica's) has died."""
    replicas = _state(request).replicas
    for i, engine in enumerate(replicas):
        which = f"replica {i}: " if len(replicas) > 1 else ""
        if engine.dead_reason is not None:
            raise APIError(503, f"{which}engine loop died: {engine.dead_reason}", code="engine_dead")
        worker_death = engine.engine.dead  # a tensor-parallel worker may die while the loop idles
        if worker_death is not None:
            raise APIError(503, f"{which}engine cannot serve: {worker_death}", code="engine_dead")
    if any(engine.draining for engine in replicas):
        raise APIError(503, "the server is shutting down", code="shutting_down")
    return _json(HealthResponse("ok"))


async def metrics(request: Request) -> Response:
    s = _state(request)
    collectors = s.metrics_collectors()
    if not collectors:
        raise APIError(404, "metrics are disabled (no metrics observer in the pipeline's `observers`)", code="not_found")
    return Response(render(collectors), media_type="text/plain; version=0.0.4; charset=utf-8")


async def tokenize(request: Request) -> Response:
    s = _state(request)
    body = await decode_body(request, TokenizeRequest, s.limits.max_body_bytes)
    s.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        tokens = await run_in_threadpool(encode_messages, body.messages, body.add_generation_prompt, s)
    else:
        tokens = await run_in_threadpool(s.engine.tokenizer.encode, body.prompt, body.add_special_tokens)
    return _json(TokenizeResponse(len(tokens), s.engine.max_model_len, tokens))


async def detokenize(request: Request) -> Response:
    s = _state(request)
    body = await decode_body(request, DetokenizeRequest, s.limits.max_body_bytes)
    s.check_model(body.model)
    vocab = s.engine.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return _json(DetokenizeResponse(s.engine.tokenizer.decode(body.tokens)))


async def openapi(request: Request) -> Response:
    """The OpenAPI 3.1 document (built once, from the msgspec structs)."""
    return Response(_state(request).openapi(), media_type="application/json")


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    Route("/v1/completions", create_completion, methods=["POST"]),
    Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
