"""Request streams into HTTP: SSE responses, several streams read as one, client disconnects.

A client that goes away must stop its generation at once, even while no token is due
(queued, or in a long prefill). uvicorn's ``send`` silently drops writes to a closed
connection, so writing alone never notices; a watcher task reads ``receive`` for
``http.disconnect`` instead and cancels the work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from modserve.core.async_engine import RequestStream
from modserve.core.outputs import RequestOutput
from modserve.core.parallel_sampling import Finals
from modserve.server.protocol import encoder

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


# Characters JSON leaves raw inside strings that Python's str.splitlines, hence httpx's
# iter_lines, takes for line ends: an event whose text held one reached such clients cut in
# two. Escaped, the JSON means the same.
_LINE_BREAKS_IN_STRINGS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def event_json(obj: Any) -> bytes:
    """``obj`` as JSON for one SSE ``data:`` line: no byte in it that any client reads as a line end."""
    data = encoder.encode(obj)
    for raw, escaped in _LINE_BREAKS_IN_STRINGS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse(obj: Any) -> bytes:
    return b"data: " + event_json(obj) + b"\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_of(work: Awaitable[T], receive: Receive) -> T:
    """Run ``work`` unless the client disconnects first (then raise :class:`ClientDisconnected`)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    return await _first_of(work, request.receive)


class EventStream(StreamingResponse):
    """``text/event-stream`` that cancels its events when the client leaves; ``on_close`` always runs."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _first_of(self.stream_response(send), receive)
        except ClientDisconnected:
            scope.setdefault("state", {})["disconnected"] = True
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def iterate(streams: list[RequestStream], timeout_s: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they arrive, tagged with the stream's position.

    Raises ``TimeoutError`` once ``timeout_s`` has passed (``server.request_timeout_s``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def collect(streams: list[RequestStream], timeout_s: float | None) -> list[RequestOutput]:
    """Each stream's final output with all its choices (for non-streamed responses)."""
    finals = Finals()
    async for _, out in iterate(streams, timeout_s):
        finals.add(out)
    return [finals.get(s.request_id) for s in streams]
