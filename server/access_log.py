"""One access-log line per HTTP request: id, status, token counts, latency.

Prompt and output text are logged only with ``server.log_prompts`` (they may hold personal data).
Handlers fill the request's :class:`AccessRecord`; the line is written when the response
ends, so a streamed response reports its final token count.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("modserve.access")


@dataclass
class AccessRecord:
    request_id: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt: Any = None  # only with server.log_prompts
    output: Any = None  # generated texts, only with server.log_prompts


def record(request: Request) -> AccessRecord:
    return request.scope.setdefault("state", {}).setdefault("access", AccessRecord())


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        rec = state.setdefault("access", AccessRecord())
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            client = scope.get("client") or ("-", 0)
            line = (
                f'{client[0]} "{scope["method"]} {scope["path"]}" {status} id={rec.request_id or "-"} '
                f"prompt_tokens={rec.prompt_tokens} output_tokens={rec.output_tokens} "
                f"latency={time.perf_counter() - t0:.3f}s"
            )
            if state.get("disconnected"):
                line += " client_disconnected"
            if rec.prompt is not None:
                line += f" prompt={json.dumps(rec.prompt, ensure_ascii=False)}"
            if rec.output is not None:
                line += f" output={json.dumps(rec.output, ensure_ascii=False)}"
            log.info(line)
