"""What every handler needs, kept on ``app.state.server``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from modserve.core.async_engine import AsyncEngine
from modserve.core.config import ServerSection, api_keys
from modserve.core.server.errors import APIError
from modserve.core.server.limits import Limits
from modserve.core.server.openapi import build_openapi
from modserve.plugins.observers.metrics import MetricsObserver
from modserve.plugins.observers.tracing import TracingObserver


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerSection
    metrics: MetricsObserver | None = None
    tracing: TracingObserver | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    limits: Limits = None  # type: ignore[assignment]  # from ``config`` unless given
    _openapi: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = Limits.from_config(self.config)

    def openapi(self) -> bytes:
        if self._openapi is None:
            doc = build_openapi(self.model_name, bool(api_keys(self.config)), self.config.auth_exempt_paths)
            self._openapi = msgspec.json.encode(doc)
        return self._openapi

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (a missing ``model`` means the served one)."""
        if name is not None and name != self.model_name:
            raise APIError(
                404, f"model {name!r} not found; this server serves {self.model_name!r}", "model", "model_not_found"
            )
