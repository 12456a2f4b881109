"""Bearer-token auth: 401 in OpenAI's error shape unless the key matches or the path is exempt.

Keys are compared with ``hmac.compare_digest`` against every configured key (no early
exit), so response timing does not reveal how much of a guess was right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from modserve.server.errors import APIError


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: list[str], exempt_paths: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.exempt = set(exempt_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt or self._authorized(scope):
            return await self.app(scope, receive, send)
        err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        err.headers["WWW-Authenticate"] = "Bearer"
        await err.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(key, token)
        return ok
