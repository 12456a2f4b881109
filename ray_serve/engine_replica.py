"""The engine deployment: one pipeline engine per Ray replica, behind the server's own app.

The model is loaded on the thread that then runs the engine loop (see
:meth:`~modserve.core.async_engine.AsyncEngine.run_loop` for why that thread matters on the
CPU). The replica reports the engine's own counters twice: to the request router
(``record_routing_stats``) and to the autoscaler (``record_autoscaling_stats``). A dead engine
fails Ray's health check, so Ray replaces the replica.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve

from modserve.core.async_engine import AsyncEngine
from modserve.core.config import load_pipeline
from modserve.core.engine import Engine
from modserve.ray_serve.forwarding import START, ForwardedRequest, run_asgi
from modserve.server.app import build_app


class EngineReplica:
    """Ray Serve deployment class (decorated in :mod:`modserve.ray_serve.app`)."""

    async def __init__(self, pipeline: dict[str, Any], num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        cfg = load_pipeline(pipeline)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()

        def load_then_run() -> None:
            try:
                built = Engine.from_config(cfg)
                built.capture_graphs()  # before Ray sends the first request, as modserve serve does
                engine = AsyncEngine(built)
                engine.claim_loop()
            except BaseException as e:  # noqa: BLE001 - handed to __init__, which raises it
                loop.call_soon_threadsafe(ready.set_exception, e)
                return
            loop.call_soon_threadsafe(ready.set_result, engine)
            engine.run_loop()

        self._thread = threading.Thread(target=load_then_run, name="modserve-engine", daemon=True)
        self._thread.start()
        self.engine: AsyncEngine = await ready
        self.engine.start()
        self.app = build_app(self.engine)  # its lifespan is not run: the engine is started here
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def handle(self, request: ForwardedRequest, routing_key: int | None = None) -> AsyncIterator[tuple]:
        """The app's response to ``request``, streamed, its headers naming this replica
        (``x-modserve-replica``, as the single-machine server names its replicas). ``routing_key``
        is read by the request router (the prompt's prefix key), not here."""
        async for piece in run_asgi(self.app, request):
            if piece[0] == START:
                piece = (START, piece[1], [*piece[2], (b"x-modserve-replica", self.replica_id.encode())])
            yield piece

    def record_routing_stats(self) -> dict[str, float]:
        """The engine's own load, not Ray's count of calls: for the request router, and (as
        ``record_autoscaling_stats``) for the autoscaling policy (:mod:`modserve.ray_serve.autoscaling`)."""
        return {"active": float(self.engine.num_active), "waiting": float(self.engine.num_waiting),
                "kv_usage": float(self.engine.kv_usage)}

    record_autoscaling_stats = record_routing_stats

    def check_health(self) -> None:
        if self.engine.dead_reason is not None:
            raise RuntimeError(f"engine loop died: {self.engine.dead_reason}")

    def whoami(self) -> tuple[str, int]:
        """This replica's id and process id (the smoke test kills a replica by its pid)."""
        return self.replica_id, os.getpid()

    async def __del__(self) -> None:
        """Ray stops a replica (scale-down, redeploy) only after its requests finished or its
        graceful-shutdown time ran out; whatever is left is aborted here."""
        await self.engine.stop()
        self.engine.engine.shutdown()
