"""The ingress deployment: HTTP in from Ray Serve's proxy, forwarded whole to an engine replica.

It computes the request's prefix key (:mod:`modserve.ray_serve.routing_key`), which the
request router reads, and relays the engine replica's response as it comes. A replica that
dies before sending any body costs nothing visible: the request goes to another replica, at
most ``ray.max_retries`` times, and its response carries ``x-modserve-retries``. One that
dies mid-stream ends the stream with the error event the single-machine server sends when its
engine dies (OpenAI's ``data: {"error": ...}`` then ``[DONE]``; Responses' ``error`` event).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import ray.exceptions
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from modserve.ray_serve.forwarding import BODY, ForwardedRequest
from modserve.ray_serve.routing_key import RoutingKeys
from modserve.server.errors import APIError
from modserve.server.protocol import encoder
from modserve.server.responses_protocol import ResponseEvent
from modserve.server.streaming import DONE, sse

log = logging.getLogger("modserve.ray")

# What a replica's death looks like to its caller: the actor is gone, or cannot be reached.
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _lost(message: str) -> APIError:
    return APIError(503, message, code="replica_failed")


class Relay(Response):
    """Sends the replica's status and headers as they are, then its body pieces as they come."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes | None, gen, rest, path: str) -> None:
        self.status_code = status
        self.raw_headers = headers
        self.background = None
        self._first, self._gen, self._rest, self._path = first, gen, rest, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        events = 0
        try:
            if self._first is not None:
                await send({"type": "http.response.body", "body": self._first, "more_body": True})
                events += self._first.count(b"\n\n")
            async for piece in self._rest:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                events += piece.count(b"\n\n")
        except Exception as e:  # noqa: BLE001 - whatever broke the relay, the client gets a clean end
            log.warning("engine replica lost mid-response (%s): %s: %s", self._path, type(e).__name__, e)
            if self._is_event_stream():
                await send({"type": "http.response.body", "body": self._error_event(events), "more_body": True})
        finally:  # the client left, or the relay ended: stop the replica's generation either way
            await self._rest.aclose()
            self._gen.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _is_event_stream(self) -> bool:
        return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.raw_headers)

    def _error_event(self, seq: int) -> bytes:
        err = _lost("the engine replica serving this request failed mid-stream; the output is incomplete")
        if self._path.endswith("/responses"):
            event = ResponseEvent("error", seq, message=err.message, code=err.code, param=None)
            return b"event: error\ndata: " + encoder.encode(event) + b"\n\n"
        return sse(err.body()) + DONE


async def _bodies(gen) -> AsyncIterator[bytes]:
    async for piece in gen:
        if piece[0] == BODY:
            yield piece[1]


class Ingress:
    """Ray Serve deployment class (decorated in :mod:`modserve.ray_serve.app`)."""

    def __init__(self, engine, block_size: int, max_retries: int) -> None:
        self.engine = engine  # DeploymentHandle of the engine replicas
        self.keys = RoutingKeys(block_size)
        self.max_retries = max_retries

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        scope = request.scope
        forwarded = ForwardedRequest(
            request.method, scope["path"], scope.get("query_string", b""),
            [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])], body,
            tuple(scope["client"]) if scope.get("client") else None,
        )
        key = self.keys.key(forwarded.path, body) if request.method == "POST" else None
        lost: Exception | None = None
        for attempt in range(self.max_retries + 1):
            gen = self.engine.options(stream=True).handle.remote(forwarded, routing_key=key)
            bodies = _bodies(gen)
            try:
                _, status, headers = await gen.__anext__()
                first = await anext(bodies, None)  # hold the answer until its first byte is safe to send
            except REPLICA_LOST as e:
                gen.cancel()
                lost = e
                log.warning("engine replica lost before answering %s (attempt %d): %s", forwarded.path, attempt + 1, e)
                continue
            except BaseException:
                gen.cancel()
                raise
            if attempt:
                headers = [*headers, (b"x-modserve-retries", str(attempt).encode())]
            return Relay(status, headers, first, gen, bodies, forwarded.path)
        return _lost(
            f"no engine replica could answer: {self.max_retries + 1} attempt(s) failed "
            f"(ray.max_retries is {self.max_retries}); last: {type(lost).__name__}"
        ).response()
