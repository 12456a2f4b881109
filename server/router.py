"""Data-parallel replicas: N engines behind one HTTP front, and the router that picks one.

Every replica is a full :class:`~modserve.core.engine.Engine` built from the same pipeline,
each on its own :class:`~modserve.core.async_engine.AsyncEngine` thread in the server
process (torch releases the GIL inside its ops, so the threads overlap on model work).

Routing is prefix-aware (:class:`~modserve.server.prefix_affinity.PrefixAffinity`, the rule the
Ray Serve request router uses too): a prompt's leading full KV blocks and its ``cache_salt``
make a key, remembered with the replica that took it, so prompts sharing those blocks land
where the prefix cache is already warm, unless that replica is much busier than the
least-loaded one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from modserve.core.async_engine import AsyncEngine
from modserve.server.prefix_affinity import PrefixAffinity


class Router(PrefixAffinity):
    """The in-process case: replicas are list indices, loads their active requests."""

    def __init__(self, num_replicas: int, block_size: int, max_blocks: int = 4, max_entries: int = 4096) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas: expected >= 1, got {num_replicas}")
        super().__init__(block_size, max_blocks, max_entries)
        self.num_replicas = num_replicas

    def pick(
        self, token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[int],
        eligible: Sequence[bool] | None = None,
    ) -> int:
        """The replica for this prompt, given each replica's active requests (``loads``).

        ``eligible`` (per replica) excludes replicas that cannot serve (dead or draining),
        unless none can."""
        if self.num_replicas == 1:
            return 0
        key = self.key(token_ids, cache_salt)
        candidates = {i: load for i, load in enumerate(loads) if eligible is None or eligible[i]}
        choice = self.choose(key, candidates or dict(enumerate(loads)))
        self.remember(key, choice)
        return choice


class Replicas:
    """The replicas as one engine for the server's lifecycle (:class:`~modserve.server.lifecycle.Runner`):
    start/stop/drain/abort cover all of them; the server dies when any one dies."""

    def __init__(self, engines: Sequence[AsyncEngine]) -> None:
        self.engines = list(engines)

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, i: int) -> AsyncEngine:
        return self.engines[i]

    def __iter__(self):
        return iter(self.engines)

    @property
    def num_active(self) -> int:
        return sum(e.num_active for e in self.engines)

    @property
    def draining(self) -> bool:
        return any(e.draining for e in self.engines)

    @property
    def dead_reason(self) -> str | None:
        for i, e in enumerate(self.engines):
            if e.dead_reason is not None:
                return f"replica {i}: {e.dead_reason}" if len(self.engines) > 1 else e.dead_reason
        return None

    def start(self) -> None:
        for e in self.engines:
            e.start()

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.engines))

    async def drain(self, grace_s: float) -> None:
        for e in self.engines:  # refuse new requests everywhere first
            e.draining = True
        await asyncio.gather(*(e.drain(grace_s) for e in self.engines))

    def abort_all(self) -> None:
        for e in self.engines:
            e.abort_all()

    async def wait_dead(self) -> str:
        """The first replica death (the reason names the replica when there are several)."""
        waits = [asyncio.ensure_future(e.wait_dead()) for e in self.engines]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self.dead_reason or next(iter(done)).result()


class ReplicaHeaderMiddleware:
    """Adds ``x-modserve-replica`` (the replica of each prompt, comma-separated) to generation responses."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})

        async def send_header(message) -> None:
            picks = state.get("replicas")
            if message["type"] == "http.response.start" and picks is not None:
                value = ",".join(str(i) for i in picks).encode()
                message = {**message, "headers": [*message.get("headers", []), (b"x-modserve-replica", value)]}
            await send(message)

        await self.app(scope, receive, send_header)
