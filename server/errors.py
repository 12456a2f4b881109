"""Every error leaves the server as OpenAI's JSON: ``{"error": {message, type, param, code}}``.

Handlers raise :class:`APIError`; the exception handlers here turn it, starlette's
``HTTPException`` (unknown route, wrong method) and anything unexpected into that shape,
so a client never sees an HTML page or a bare traceback.
"""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from modserve.core.async_engine import EngineDeadError, RequestAbortedError, RequestFailedError, ServerBusyError
from modserve.server.protocol import ErrorBody, ErrorResponse, encoder

log = logging.getLogger("modserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, _TYPES.get(self.status, "server_error"), self.param, self.code))

    def response(self) -> Response:
        return Response(encoder.encode(self.body()), self.status, self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


_FIELD_RE = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def from_value_error(err: ValueError) -> APIError:
    """``SamplingParams`` / engine messages start with ``field: ``; that becomes ``param``."""
    message = str(err)
    m = _FIELD_RE.match(message)
    return bad_request(message, m.group(1) if m else None)


_AT_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.S)


def from_decode_error(err: msgspec.DecodeError) -> APIError:
    if not isinstance(err, msgspec.ValidationError):
        return bad_request(f"invalid JSON body: {err}", code="invalid_json")
    m = _AT_RE.match(str(err))
    msg, path = m.group("msg").replace("`", ""), m.group("path") or ""
    missing = re.match(r"Object missing required field (\S+)", msg)
    if missing:
        path, msg = ".".join(filter(None, [path, missing.group(1)])), "required field is missing"
    msg = msg[:1].lower() + msg[1:]
    return bad_request(f"{path}: {msg}" if path else msg, path or None)


def from_undecodable(err: UnicodeDecodeError | RecursionError) -> APIError:
    """The two ways msgspec fails outside ``DecodeError``: bad UTF-8 inside a string, and nesting
    deeper than it recurses (both anywhere in the body, unknown fields included)."""
    if isinstance(err, UnicodeDecodeError):
        return bad_request("invalid JSON body: a string is not valid UTF-8", code="invalid_json")
    return bad_request("invalid JSON body: nested too deeply", code="invalid_json")


def from_engine_error(err: Exception) -> APIError:
    """Map what admission or a request stream raises to the HTTP error the client sees."""
    if isinstance(err, ServerBusyError):
        return APIError(503, str(err), code=err.code, headers={"Retry-After": str(err.retry_after_s)})
    if isinstance(err, RequestAbortedError):
        return APIError(503, str(err), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), code="engine_dead")
    if isinstance(err, ValueError):
        return from_value_error(err)
    if isinstance(err, TimeoutError):
        return APIError(504, "the request exceeded server.request_timeout_s", code="timeout")
    if isinstance(err, RequestFailedError):
        return APIError(500, str(err), code="engine_error")
    log.error("unexpected error while generating", exc_info=err)
    return APIError(500, f"internal server error: {type(err).__name__}", code="internal_error")


async def handle_api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    messages = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} not allowed"}
    message = messages.get(exc.status_code, str(exc.detail))
    return APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None).response()


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()


EXCEPTION_HANDLERS = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
