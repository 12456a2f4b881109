"""One HTTP request carried whole from the ingress to an engine replica, and run there.

The engine replica answers through the same Starlette app ``modserve serve`` runs, so every
route, error and stream is the one the single-machine server gives. The ingress sends the
request's method, path, query, headers and body; :func:`run_asgi` plays them into the app and
yields the response as ``("start", status, headers)`` then ``("body", bytes)`` pieces, which
Ray streams back. Closing the generator (the client left, or the ingress gave up) tells the
app the client disconnected, which aborts the generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

START, BODY = "start", "body"
_END = object()


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None


def _scope(req: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode(),
        "root_path": "",
        "query_string": req.query_string,
        "headers": req.headers,
        "client": req.client,
        "server": None,
        "state": {},
    }


async def run_asgi(app: Any, req: ForwardedRequest) -> AsyncIterator[tuple]:
    """The app's response to ``req``, piece by piece; closing the iterator disconnects the client."""
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(_scope(req), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(_END))
    try:
        while True:
            message = await sent.get()
            if message is _END:
                task.result()  # the app's own failure, if any
                return
            if message["type"] == "http.response.start":
                yield START, message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield BODY, bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
