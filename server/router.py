"""Data-parallel replicas: N engines behind one HTTP front, and the router that picks one.

Every replica is a full :class:`~modserve.core.engine.Engine` built from the same pipeline,
each on its own :class:`~modserve.core.async_engine.AsyncEngine` thread in the server
process (torch releases the GIL inside its ops, so the threads overlap on model work).

Routing is prefix-aware: a prompt's leading *full* KV blocks (``block_size`` tokens each,
at most ``max_blocks`` of them) plus its ``cache_salt`` make a key, and a bounded LRU map
remembers which replica last served that key, so prompts sharing those blocks land where
the prefix cache is already warm. A new key, a prompt shorter than one block, or a
remembered replica much busier than the least-loaded one (``load > 2 * least + 4`` active
requests) goes to the least-loaded replica instead (ties rotate), and the map is updated.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from modserve.core.async_engine import AsyncEngine


class Router:
    """Picks a replica for a prompt; event-loop thread only (not thread-safe)."""

    def __init__(self, num_replicas: int, block_size: int, max_blocks: int = 4, max_entries: int = 4096) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas: expected >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_entries = max_entries
        self._map: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica, least recently used first
        self._next = 0  # rotates ties between equally loaded replicas

    def key(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        """The prefix key: ``None`` when the prompt has no full block (nothing cacheable to share)."""
        n = min(len(token_ids) // self.block_size, self.max_blocks) * self.block_size
        if n == 0:
            return None
        return hash((cache_salt, tuple(token_ids[:n])))

    def least_loaded(self, loads: Sequence[int], eligible: Sequence[bool] | None = None) -> int:
        n = len(loads)
        order = [(i + self._next) % n for i in range(n)]
        candidates = [i for i in order if eligible is None or eligible[i]] or order
        best = min(candidates, key=lambda i: loads[i])
        self._next = (best + 1) % n
        return best

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
        ok = [True] * len(loads) if eligible is None else list(eligible)
        if key is not None and key in self._map:
            sticky = self._map[key]
            least = min((loads[i] for i in range(len(loads)) if ok[i]), default=loads[sticky])
            if ok[sticky] and loads[sticky] <= 2 * least + 4:
                self._map.move_to_end(key)
                return sticky
        choice = self.least_loaded(loads, ok)
        if key is not None:
            self._map[key] = choice
            self._map.move_to_end(key)
            while len(self._map) > self.max_entries:
                self._map.popitem(last=False)
        return choice

    def __len__(self) -> int:
        return len(self._map)


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
