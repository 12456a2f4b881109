"""Reads a request body under the configured size limit and decodes it strictly."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.requests import Request

from modserve.core.server.errors import APIError, from_decode_error

T = TypeVar("T")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes (server.max_body_bytes)", code="request_too_large")


async def decode_body(request: Request, struct: type[T], limit: int) -> T:
    """The body as ``struct``: 413 past ``limit`` bytes (checked while reading), 400 if malformed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    try:
        return msgspec.json.decode(b"".join(chunks), type=struct)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
