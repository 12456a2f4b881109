"""Fixed-size KV blocks with ref counts, a free queue and a content-hash index.

Freed blocks keep their contents; the eviction policy (LRU by default: hashed blocks
to the queue's tail, unhashed to its head) decides which idle block is handed out next.
A cached block is evicted lazily, only when its slot is handed out again. A hash hit also compares the stored token ids, so a hash
collision can never serve another prompt's KV.
"""

from __future__ import annotations

from modserve.core.contract import EvictionPolicy
from modserve.plugins.eviction.lru import LRUEviction


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free_queue = policy if policy is not None else LRUEviction()  # an empty policy is falsy
        for block in range(num_blocks):
            self.free_queue.add(block, cached=False)
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached contents.

        They come back in ascending order: the queue hands out neighbours in descending
        order (a fresh pool N-1, N-2, ...; freed requests tail-first), and attention reads a
        sequence's blocks front to back, so ascending runs are forward streams for the
        CPU's prefetchers (the CPU kernel: 72 vs 82 ms for the same 256 x 350 decode)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"block pool exhausted: asked for {n}, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.pop()
            self._evict(block)
            self.ref_cnt[block] = 1
            out.append(block)
        out.sort()
        return out

    def touch(self, blocks: list[int]) -> None:
        """Share blocks found by a prefix hit: +1 ref, out of the free queue if idle."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                self.free_queue.remove(block)
            self.ref_cnt[block] += 1
            self.free_queue.hit(block)

    def share(self, blocks: list[int]) -> None:
        """One more owner for blocks already in use (a forked sequence)."""
        for block in blocks:
            assert self.ref_cnt[block] > 0, f"block {block} is not in use"
            self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one ref from each block; idle ones return to the free queue.

        Callers pass a request's blocks tail-first so that, among equally old blocks, a
        prompt's later blocks are evicted before its earlier (more shareable) ones.
        """
        for block in blocks:
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
            if self.ref_cnt[block] == 0:
                self.free_queue.add(block, cached=self.block_hash[block] is not None)

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        block = self.cached.get(block_hash)
        if block is None or self.block_tokens[block] != tokens:
            return None
        return block

    def cache(self, block: int, block_hash: bytes, tokens: tuple[int, ...]) -> None:
        """Publish a full block's contents; a duplicate of an existing entry stays private."""
        if block_hash in self.cached or self.block_hash[block] is not None:
            return
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tokens

    def reset_cache(self) -> None:
        for block in range(self.num_blocks):
            self._evict(block)

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
