"""Reads a request body under the configured size limit and decodes it strictly.

Whatever the bytes are (malformed JSON, invalid UTF-8, nesting deeper than the decoder
recurses, duplicate keys: the last one wins, as in Python's ``json``), the client gets a
400 in OpenAI's error shape, never a 500."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.requests import Request

from modserve.server.errors import APIError, from_decode_error, from_undecodable
from modserve.server.fields import check_fields

T = TypeVar("T")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes (server.max_body_bytes)", code="request_too_large")


async def decode_body(request: Request, struct: type[T], limit: int, endpoint: str | None = None) -> T:
    """The body as ``struct``: 413 past ``limit`` bytes (checked while reading), 400 if malformed.
    With ``endpoint`` (``completions``, ``chat``), a field it does not support is a 400 naming it
    (:mod:`modserve.server.fields`)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = msgspec.json.decode(raw, type=struct)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except (UnicodeDecodeError, RecursionError) as e:  # msgspec raises these, not DecodeError
        raise from_undecodable(e) from None
    if endpoint is not None:
        check_fields(raw, struct, endpoint)
    return body
