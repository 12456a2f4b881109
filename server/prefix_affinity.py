"""The routing rule shared by every multi-replica front: keep a prompt's prefix where it is cached.

A prompt's leading *full* blocks (``block_size`` units each, at most ``max_blocks``) plus its
``cache_salt`` make a key; a bounded LRU map remembers which replica last took that key. A
remembered replica keeps the key unless it is much busier than the least-loaded candidate
(``load > 2 * least + 4``); a new key, a key without a remembered live replica, or a prompt
shorter than one block goes to the least-loaded candidate (ties rotate).

Units are whatever the caller can see before the prompt reaches an engine: token ids in the
in-process router (:mod:`modserve.server.router`), characters of the request text in the Ray
Serve ingress (:mod:`modserve.ray_serve.routing_key`), which holds no tokenizer. Replicas are
any hashable ids: list indices in-process, Ray's replica ids on Ray Serve.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence


def prefix_key(units: Sequence, block_size: int, max_blocks: int, cache_salt: str | None = None) -> int | None:
    """The key of a prompt's leading full blocks (at most ``max_blocks``) and its salt; ``None``
    when it has no full block (nothing cacheable to share)."""
    n = min(len(units) // block_size, max_blocks) * block_size
    if n == 0:
        return None
    return hash((cache_salt, tuple(units[:n]) if not isinstance(units, str) else units[:n]))


class PrefixAffinity:
    """Picks a replica for a prefix key; not thread-safe (one event loop owns it)."""

    def __init__(self, block_size: int, max_blocks: int = 4, max_entries: int = 4096) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1, got {block_size}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_entries = max_entries
        self._map: OrderedDict[int, Hashable] = OrderedDict()  # key -> replica, least recently used first
        self._turn = 0  # rotates ties between equally loaded replicas

    def key(self, units: Sequence, cache_salt: str | None = None) -> int | None:
        """The prefix key in this router's blocks (:func:`prefix_key`)."""
        return prefix_key(units, self.block_size, self.max_blocks, cache_salt)

    def choose(self, key: int | None, loads: Mapping[Hashable, int]) -> Hashable:
        """The replica for ``key`` among ``loads`` (candidate -> requests it holds; not empty)."""
        least = min(loads.values())
        if key is not None:
            sticky = self._map.get(key)
            if sticky in loads and loads[sticky] <= 2 * least + 4:
                return sticky
        ties = [r for r, load in loads.items() if load == least]
        choice = ties[self._turn % len(ties)]
        self._turn += 1
        return choice

    def remember(self, key: int | None, replica: Hashable) -> None:
        """Record that ``replica`` took ``key`` (its prefix is cached there now)."""
        if key is None:
            return
        self._map[key] = replica
        self._map.move_to_end(key)
        while len(self._map) > self.max_entries:
            self._map.popitem(last=False)

    def owner(self, key: int | None) -> Hashable | None:
        """The replica remembered for ``key`` (None: none)."""
        return None if key is None else self._map.get(key)

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: int) -> bool:
        return key in self._map
