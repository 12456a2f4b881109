"""What every handler needs, kept on ``app.state.server``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from modserve.core.async_engine import AsyncEngine
from modserve.core.config import ServerSection, api_keys
from modserve.server.errors import APIError
from modserve.server.limits import Limits
from modserve.server.openapi import build_openapi
from modserve.server.router import Router


@dataclass
class ServerState:
    engine: AsyncEngine  # replica 0: tokenizer, model facts; the only one without replicas
    config: ServerSection
    created: int = field(default_factory=lambda: int(time.time()))
    limits: Limits = None  # type: ignore[assignment]  # from ``config`` unless given
    replicas: list[AsyncEngine] = None  # type: ignore[assignment]  # data-parallel engines; [engine] unless given
    router: Router | None = None  # picks the replica of each prompt (None: one replica)
    _openapi: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = Limits.from_config(self.config)
        if self.replicas is None:
            self.replicas = [self.engine]

    def pick_replica(self, token_ids: list[int], cache_salt: str | None) -> int:
        """The replica that serves this prompt (always 0 with one replica)."""
        if self.router is None or len(self.replicas) == 1:
            return 0
        loads = [e.num_active for e in self.replicas]
        eligible = [e.dead_reason is None and not e.draining for e in self.replicas]
        return self.router.pick(token_ids, cache_salt, loads, eligible)

    def metrics_collectors(self) -> list:
        """Every replica's observers' Prometheus collectors (empty: no metrics observer)."""
        return [c for e in self.replicas for found in e.engine.hooks.prometheus_collectors() for c in found]

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
