"""KV backend ``scratch``: a block pool written against the contract alone.

No prefix cache, a stack of free blocks, and ``n > 1`` siblings that get a copy of their
parent's blocks through ``copy_blocks`` (so tensor parallelism replays it on every rank).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from modserve.core.contract import BlockCopy, BuildContext, KVBackend, LayerKVCache, PrefixHit, hookimpl

MODSERVE_CONTRACT = "2.0"


class ScratchConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    block_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    num_blocks: Annotated[int, msgspec.Meta(ge=1)] = 256


class ScratchKV(KVBackend):
    Config = ScratchConfig

    def __init__(self, config: ScratchConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        spec = ctx.kv_spec
        self.block_size, self.num_blocks = config.block_size, config.num_blocks
        shape = (self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        alloc = ctx.platform.allocate_kv
        self._caches = [LayerKVCache(alloc(shape, spec.dtype), alloc(shape, spec.dtype)) for _ in range(spec.num_layers)]
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._blocks: dict[str, list[int]] = {}
        self.fork_copies = 0

    def lookup_prefix(self, request) -> PrefixHit:
        return PrefixHit()

    def allocate(self, request, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> bool:
        blocks = self._blocks.setdefault(request.request_id, [])
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks)
        if need > len(self._free):
            return False
        blocks += [self._free.pop() for _ in range(max(need, 0))]
        return True

    def free(self, request) -> None:
        self._free += reversed(self._blocks.pop(request.request_id, []))

    def block_table(self, request) -> list[int]:
        return self._blocks.get(request.request_id, [])

    def cache_blocks(self, request, num_verified_tokens: int) -> None:
        pass  # no prefix cache

    def layer_caches(self) -> list[LayerKVCache]:
        return self._caches

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def fork(self, parent, child) -> bool:
        used = -(-parent.num_computed_tokens // self.block_size)
        if used > len(self._free):
            return False
        src = self._blocks[parent.request_id][:used]
        dst = [self._free.pop() for _ in range(used)]
        self.copy_blocks(BlockCopy("device", tuple(src), "device", tuple(dst)))
        self._blocks[child.request_id] = dst
        self.fork_copies += used
        return True

    def trim(self, request, num_tokens: int) -> None:
        blocks = self._blocks.get(request.request_id, [])
        keep = -(-num_tokens // self.block_size)
        while len(blocks) > keep:
            self._free.append(blocks.pop())


@hookimpl
def register_kv_backends():
    return {"scratch": ScratchKV}
