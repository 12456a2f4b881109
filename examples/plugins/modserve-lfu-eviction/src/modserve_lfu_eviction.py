"""Eviction policy ``lfu``: hot shared prefixes stay cached while one-off prompts churn.

LRU hands out the least recently freed cached block, so a system prompt shared by every
request is evicted as soon as enough one-off prompts have passed through the pool. Here a
cached block's priority is the number of prefix hits its contents served plus an aging
floor, and the lowest priority is evicted first (LFU with dynamic aging, as in LFU-DA web
caches). The floor rises to the priority of each evicted block, so a prefix that was hot
long ago but is no longer hit eventually loses to fresh blocks instead of staying forever.

Hand-out order: idle blocks with no cached contents first, then cached blocks by lowest
priority, ties by least recently freed.
"""

from __future__ import annotations

import heapq
import itertools

from modserve.core.contract import BuildContext, EvictionPolicy, NoOptions, hookimpl

MODSERVE_CONTRACT = "2.0"


class LFUEviction(EvictionPolicy):
    """A set of uncached idle blocks and a lazy-deletion heap of cached ones."""

    Config = NoOptions

    def __init__(self, config: NoOptions | None = None, ctx: BuildContext | None = None) -> None:
        super().__init__(config, ctx)
        self._uncached: dict[int, None] = {}  # insertion-ordered; popped newest first
        self._heap: list[tuple[int, int, int]] = []  # (priority, seq, block); may hold stale entries
        self._queued: dict[int, tuple[int, int]] = {}  # cached idle block -> its live (priority, seq)
        self._hits: dict[int, int] = {}  # block -> prefix hits served by its current contents
        self._floor = 0
        self._seq = itertools.count()

    def add(self, block: int, cached: bool) -> None:
        if not cached:
            self._hits.pop(block, None)
            self._uncached[block] = None
            return
        key = (self._floor + self._hits.get(block, 0), next(self._seq))
        self._queued[block] = key
        heapq.heappush(self._heap, (*key, block))
        if len(self._heap) > 2 * len(self._queued) + 64:  # drop stale entries left by remove()
            self._heap = [(*key, b) for b, key in self._queued.items()]
            heapq.heapify(self._heap)

    def remove(self, block: int) -> None:
        if block in self._uncached:
            del self._uncached[block]
        else:
            del self._queued[block]  # its heap entry is now stale; pop() skips it

    def pop(self) -> int:
        if self._uncached:
            return self._uncached.popitem()[0]
        while True:
            priority, seq, block = heapq.heappop(self._heap)
            if self._queued.get(block) == (priority, seq):
                del self._queued[block]
                self._hits.pop(block, None)  # the pool evicts its contents now
                self._floor = priority
                return block

    def hit(self, block: int) -> None:
        self._hits[block] = self._hits.get(block, 0) + 1

    def __len__(self) -> int:
        return len(self._uncached) + len(self._queued)

    def __contains__(self, block: int) -> bool:
        return block in self._uncached or block in self._queued


@hookimpl
def register_eviction_policies():
    return {"lfu": LFUEviction}
