"""KV backend ``contiguous``: reserves ``max_model_len`` slots per request up front.

This is how servers worked before PagedAttention: memory is claimed for the longest
possible sequence at admission. It exists as a research baseline, so that benchmarks
can measure the waste and lost concurrency that paging removes. No prefix caching.
"""

from __future__ import annotations

import msgspec

from modserve.core.contract import BlockCopy, BuildContext, PrefixHit, hookimpl
from modserve.core.request import Request
from modserve.plugins.kv_backends.paged import PagedConfig, PagedKVBackend

MODSERVE_CONTRACT = "2.0"


class ContiguousConfig(PagedConfig, kw_only=True):
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefix_caching:
            raise ValueError("prefix_caching: the contiguous baseline has no prefix cache, got True")
        if self.free_outside_window:
            raise ValueError("free_outside_window: the contiguous baseline keeps every reserved slot, got True")


class ContiguousKVBackend(PagedKVBackend):
    Config = ContiguousConfig

    def __init__(self, config: ContiguousConfig, ctx: BuildContext) -> None:
        super().__init__(msgspec.structs.replace(config, prefix_caching=False, free_outside_window=False), ctx)
        self.reservation = -(-ctx.kv_spec.max_model_len // self.block_size)  # blocks per request

    def lookup_prefix(self, request: Request) -> PrefixHit:
        return PrefixHit()

    def swap_out(self, request: Request) -> bool:
        return False  # the baseline preempts by recompute only

    def fork(self, parent: Request, child: Request) -> bool:
        """A sibling gets its own full reservation holding a copy of the parent's KV."""
        if self.reservation > self.pool.num_free:
            return False
        blocks = self.pool.allocate(self.reservation)
        used = -(-parent.num_computed_tokens // self.block_size)
        self.copy_blocks(BlockCopy("device", tuple(self._blocks[parent.request_id][:used]), "device", tuple(blocks[:used])))
        self._blocks[child.request_id] = blocks
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        pass  # reserved up front, kept to the end

    def allocate(self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> bool:
        if request.request_id in self._blocks:
            return True  # everything was reserved at admission
        if self.reservation > self.pool.num_free:
            return False
        self._blocks[request.request_id] = self.pool.allocate(self.reservation)
        return True


@hookimpl
def register_kv_backends():
    return {"contiguous": ContiguousKVBackend}
