"""``GET /openapi.json``: the API as OpenAPI 3.1, its schemas generated from the msgspec structs.

The request and response bodies are the very structs the handlers decode and encode
(:mod:`modserve.server.protocol`), passed through ``msgspec.json.schema_components``,
so the published schema cannot drift from what the server accepts. Value ranges that are
server limits (``server.max_n``, ...) or ``SamplingParams`` rules are described, not encoded:
they are configurable and answered with a 400 naming the field.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec

from modserve.server import protocol as p
from modserve.server import responses_protocol as r

_REF = "#/components/schemas/{name}"

# status -> when; every error body is ErrorResponse
_ERRORS = {
    "400": "Malformed JSON, a wrong type, a value out of range or over a server limit, or a prompt that does "
    "not fit max_model_len",
    "401": "Missing or wrong `Authorization: Bearer <key>` (when keys are configured)",
    "404": "Unknown model",
    "413": "Body larger than server.max_body_bytes",
    "500": "A plugin failed while generating this request (the message names it)",
    "503": "Waiting queue full (Retry-After: 1), shutting down (Retry-After: 5) or engine loop dead",
    "504": "server.request_timeout_s exceeded",
}


def _version() -> str:
    try:
        return importlib.metadata.version("modserve")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _errors(*statuses: str) -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}}
    return {s: {"description": _ERRORS[s], "content": body} for s in statuses}


def _json(ref: str, description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(name=ref)}}}}


def _post(summary: str, request: str, response: dict[str, Any], errors: tuple[str, ...]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF.format(name=request)}}},
            },
            "responses": {"200": response, **_errors(*errors)},
        }
    }


def _generation(ref: str, chunk: str, typed_events: bool = False) -> dict[str, Any]:
    """200 for a generation endpoint: JSON, or with ``stream: true`` server-sent events.

    As OpenAPI 3.1 tools read it, an event stream's ``schema`` describes one event: its
    ``data`` is a ``chunk`` (or, after a failure, an ErrorResponse) as JSON, or ``[DONE]``.
    ``typed_events`` (the Responses API): each event also has ``event: <type>``, an error is
    an ``error`` event, and there is no ``[DONE]``."""
    out = _json(ref)
    if typed_events:
        data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json",
                                "contentSchema": {"$ref": _REF.format(name=chunk)}}
        description = f"One event `event: <type>` + `data: <{chunk} JSON>`; the last is response.completed, " \
                      "response.incomplete or error"
    else:
        payload = {"anyOf": [{"$ref": _REF.format(name=chunk)}, {"$ref": _REF.format(name="ErrorResponse")}]}
        data = {"anyOf": [{"const": "[DONE]"},
                          {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
        description = f"One event `data: <{chunk} JSON>`; an error after the stream started arrives as " \
                      "`data: <ErrorResponse JSON>`; the stream ends with `data: [DONE]`"
    out["content"]["text/event-stream"] = {
        "schema": {"type": "object", "description": description, "required": ["data"], "properties": {"data": data}}
    }
    return out


def build_openapi(model_name: str, auth: bool, exempt_paths: list[str]) -> dict[str, Any]:
    structs = [
        p.CompletionRequest, p.Completion, p.ChatCompletionRequest, p.ChatCompletion, p.ChatCompletionChunk,
        p.TokenizeRequest, p.TokenizeResponse, p.DetokenizeRequest, p.DetokenizeResponse, p.ModelList,
        p.HealthResponse, p.ErrorResponse, p.ModelCard, p.TokenizerInfo,
        r.ResponsesRequest, r.ResponseObject, r.ResponseEvent,
    ]
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    gen_errors = ("400", "401", "404", "413", "500", "503", "504")
    paths: dict[str, Any] = {
        "/v1/models": {"get": {"summary": "The served model", "responses": {"200": _json("ModelList"), **_errors("401")}}},
        "/v1/models/{model_id}": {
            "get": {
                "summary": "The served model's card (404 for another id)",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json("ModelCard"), **_errors("401", "404")},
            }
        },
        "/tokenizer_info": {"get": {"summary": "The tokenizer's chat template and special tokens",
                                    "responses": {"200": _json("TokenizerInfo"), **_errors("401")}}},
        "/v1/completions": _post(
            "Text completion", "CompletionRequest", _generation("Completion", "Completion"), gen_errors
        ),
        "/v1/chat/completions": _post(
            "Chat completion", "ChatCompletionRequest", _generation("ChatCompletion", "ChatCompletionChunk"),
            gen_errors,
        ),
        "/v1/responses": _post(
            "Responses API (stateless: store false)", "ResponsesRequest",
            _generation("ResponseObject", "ResponseEvent", typed_events=True), gen_errors,
        ),
        "/tokenize": _post("Tokenize a prompt or messages", "TokenizeRequest", _json("TokenizeResponse"),
                           ("400", "401", "404", "413")),
        "/detokenize": _post("Detokenize token ids", "DetokenizeRequest", _json("DetokenizeResponse"),
                             ("400", "401", "404", "413")),
        "/health": {"get": {"summary": "Liveness", "responses": {"200": _json("HealthResponse"), **_errors("503")}}},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {"200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **_errors("401")},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
                              **_errors("401")},
            }
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "modserve OpenAI-compatible API",
            "version": _version(),
            "description": f"Serving {model_name!r}. Unknown request fields are ignored; known ones are typed strictly.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in paths.items():
            if path not in exempt_paths:
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return doc
