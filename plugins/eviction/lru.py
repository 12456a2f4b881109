"""Eviction policy ``lru``: idle uncached blocks first, then cached ones least recently freed."""

from __future__ import annotations

from collections import OrderedDict

from modserve.core.contract import BuildContext, EvictionPolicy, NoOptions, hookimpl

MODSERVE_CONTRACT = "2.0"


class LRUEviction(EvictionPolicy):
    """One ordered queue: uncached blocks at the head (reused first), cached ones at the tail."""

    Config = NoOptions

    def __init__(self, config: NoOptions | None = None, ctx: BuildContext | None = None) -> None:
        super().__init__(config, ctx)
        self._queue: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int, cached: bool) -> None:
        self._queue[block] = None
        if not cached:
            self._queue.move_to_end(block, last=False)

    def remove(self, block: int) -> None:
        del self._queue[block]

    def pop(self) -> int:
        return self._queue.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: int) -> bool:
        return block in self._queue

    def __iter__(self):
        return iter(self._queue)


@hookimpl
def register_eviction_policies():
    return {"lru": LRUEviction}
