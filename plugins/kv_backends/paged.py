"""KV backend ``paged``: block tables over one preallocated tensor per layer, with prefix caching.

Capacity is ``num_blocks`` or a ``memory_gb`` budget. ``kv_dtype: int8`` stores K/V as
int8 with a float32 scale per token and head (quantized on write by the attention
backend), so the same budget holds about 3.8x as many fp32 blocks.

Sliding windows (``free_outside_window``): when every layer of the model attends only to
the last ``W`` positions (Mistral-7B-v0.1, Phi-3 with a window), a block whose positions
all lie at or before ``num_computed_tokens - W`` can never be read again (a query at ``q``
sees keys ``> q - W`` and every future query has ``q >= num_computed_tokens``). ``allocate``
releases such blocks to the pool (cached contents stay reusable by prefix hits until the
block is handed out again) and puts a placeholder id in their block-table slots: one extra
zero-filled block past the pool, never written, which attention may read (its positions are
masked; the kernels skip them). A request then holds about ``(W + chunk) / block_size``
blocks instead of ``len / block_size``. Models mixing local and global layers (Gemma 2/3)
keep every block: a global layer reads every position, and freeing only the local layers'
share would need a pool per layer group.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from typing import Annotated, Literal

import msgspec
import torch

from modserve.core.contract import BlockCopy, BuildContext, KVBackend, KVSpec, LayerKVCache, PrefixHit, hookimpl
from modserve.core.request import Request
from modserve.plugins.kv_backends.block_pool import BlockPool

MODSERVE_CONTRACT = "2.0"


class PagedConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16  # tokens per block, a power of two
    num_blocks: Annotated[int, msgspec.Meta(ge=1)] | None = None  # capacity in blocks (or give memory_gb)
    memory_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None  # capacity as a memory budget (default 1 GB)
    prefix_caching: bool = True  # share KV of equal leading blocks between requests
    kv_dtype: Literal["auto", "int8"] = "auto"  # auto: the model dtype; int8: per-token, per-head scales
    eviction: str = "lru"  # an eviction policy plugin (``modserve plugins`` lists them)
    swap_space_gb: Annotated[float, msgspec.Meta(ge=0)] = 0.25  # host pool for preemption by swap
    # Release blocks behind every layer's sliding window to the pool (None: when every layer
    # of the model has one; true on another model is an error; a speculative proposer's own
    # KV keeps every block unless told)
    free_outside_window: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: expected a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.memory_gb is not None:
            raise ValueError("num_blocks and memory_gb are exclusive: give one")


def bytes_per_block(cfg: PagedConfig, spec: KVSpec) -> int:
    per_token_head = spec.head_dim * (1 if cfg.kv_dtype == "int8" else spec.dtype.itemsize)
    if cfg.kv_dtype == "int8":
        per_token_head += 4  # float32 scale
    return 2 * spec.num_layers * cfg.block_size * spec.num_kv_heads * per_token_head


class PagedKVBackend(KVBackend):
    Config = PagedConfig

    @classmethod
    def check_config(cls, config: PagedConfig, registry) -> None:
        registry.resolve("kv_cache.eviction", config.eviction)

    def __init__(self, config: PagedConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        spec = ctx.kv_spec
        self.block_size = config.block_size
        self.window = release_window(config, ctx)  # None: every block is kept for the request's life
        extra = self.window is not None  # the placeholder block behind released table slots
        if config.num_blocks is not None:
            self.num_blocks = config.num_blocks
        else:
            budget = (config.memory_gb or 1.0) * 2**30
            self.num_blocks = int(budget // bytes_per_block(config, spec)) - extra
        if self.num_blocks * self.block_size < spec.max_model_len:
            raise ValueError(
                f"kv_cache: {self.num_blocks} blocks of {self.block_size} tokens hold "
                f"{self.num_blocks * self.block_size} tokens, fewer than max_model_len {spec.max_model_len}; "
                "raise num_blocks/memory_gb or lower model.max_model_len"
            )
        self.pool = BlockPool(self.num_blocks, ctx.registry.create("kv_cache.eviction", config.eviction, ctx))
        self._platform = ctx.platform
        self._caches = [self._layer_cache(spec, self.num_blocks + extra) for _ in range(spec.num_layers)]
        self.null_block = self.num_blocks if extra else -1  # never a real block id when freeing is off
        if extra:  # allocate_kv zeroes; a platform that does not must still leave no NaN here
            for cache in self._caches:
                for t in cache.tensors().values():
                    t[self.null_block].zero_()
        self._spec = spec
        self._num_host = int(config.swap_space_gb * 2**30 // bytes_per_block(config, spec))
        self._host: list[LayerKVCache] = []  # host pool and its free list: made on the first swap-out
        self._host_free: list[int] = []
        self._swapped: dict[str, tuple[int, list[int]]] = {}  # leading placeholders, host ids of the rest
        self._released: dict[str, int] = {}  # leading table slots released behind the window
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_published: dict[str, int] = {}
        self._hash_key = os.urandom(16)  # per deployment: block keys are not predictable

    def _layer_cache(self, spec: KVSpec, num_blocks: int, host: bool = False) -> LayerKVCache:
        shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        alloc = self._platform.allocate_kv
        if self.config.kv_dtype == "int8":
            return LayerKVCache(
                k=alloc(shape, torch.int8, host),
                v=alloc(shape, torch.int8, host),
                k_scale=alloc(shape[:3], torch.float32, host),
                v_scale=alloc(shape[:3], torch.float32, host),
            )
        return LayerKVCache(k=alloc(shape, spec.dtype, host), v=alloc(shape, spec.dtype, host))

    # ----------------------------------------------------------------- block hashes

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of the request's first ``num_full_blocks`` blocks (memoised)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            h = hashlib.blake2b(key=self._hash_key, digest_size=16)
            h.update(hashes[-1] if hashes else request.cache_namespace)
            h.update(array("q", request.all_token_ids[i * bs : (i + 1) * bs]).tobytes())
            hashes.append(h.digest())
        return hashes[:num_full_blocks]

    def _tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])

    # ----------------------------------------------------------------- KVBackend

    def lookup_prefix(self, request: Request) -> PrefixHit:
        if not self.config.prefix_caching:
            return PrefixHit()
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is always recomputed
        hit = PrefixHit()
        for i, h in enumerate(self._block_hashes(request, max_blocks)):
            block = self.pool.lookup(h, self._tokens(request, i))
            if block is None:
                break
            hit.block_ids.append(block)
        hit.num_tokens = len(hit.block_ids) * self.block_size
        return hit

    def allocate(self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> bool:
        rid = request.request_id
        blocks = self._blocks.get(rid, [])
        hit = prefix_hit or PrefixHit()
        computed = request.num_computed_tokens + hit.num_tokens
        needed_tokens = computed + num_new_tokens
        num_new_blocks = -(-needed_tokens // self.block_size) - len(blocks) - len(hit.block_ids)
        # blocks no future query (positions >= computed) can see: held ones are released,
        # prefix-hit ones are not taken at all
        done = self._released.get(rid, 0)
        dead = max(self.num_dead_blocks(computed), done)
        releasing = blocks[done:dead]
        hit_dead = min(max(dead - len(blocks), 0), len(hit.block_ids))
        live_hits = hit.block_ids[hit_dead:]
        idle_hits = sum(1 for b in live_hits if self.pool.ref_cnt[b] == 0)
        freed = sum(1 for b in releasing if self.pool.ref_cnt[b] == 1)
        shared = self._shared_write_block(request, blocks)
        if max(num_new_blocks, 0) + (shared is not None) > self.pool.num_free - idle_hits + freed:
            return False
        if releasing:
            self.pool.free(releasing[::-1])
            blocks = [self.null_block] * (done + len(releasing)) + blocks[done + len(releasing) :]
        if shared is not None:
            blocks = self._copy_on_write(blocks, shared)
        if hit.block_ids:
            self.pool.touch(live_hits)
            blocks = blocks + [self.null_block] * hit_dead + live_hits
            self._num_published[rid] = len(hit.block_ids)
        if num_new_blocks > 0:
            blocks = blocks + self.pool.allocate(num_new_blocks)
        self._blocks[rid] = blocks
        if dead:
            self._released[rid] = dead
        return True

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks of a request no query at a position >= ``num_computed_tokens`` can
        attend: block ``b`` covers ``[b*B, (b+1)*B)`` and is dead once ``(b+1)*B - 1 <=
        num_computed_tokens - W`` (0 when freeing is off)."""
        if self.window is None:
            return 0
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def _shared_write_block(self, request: Request, blocks: list[int]) -> int | None:
        """Index of the block the next write lands in, if another sequence shares it."""
        i = request.num_computed_tokens // self.block_size
        if i < len(blocks) and blocks[i] != self.null_block and self.pool.ref_cnt[blocks[i]] > 1:
            return i
        return None

    def _copy_on_write(self, blocks: list[int], i: int) -> list[int]:
        (fresh,) = self.pool.allocate(1)
        self.copy_blocks(BlockCopy("device", (blocks[i],), "device", (fresh,)))
        self.pool.free([blocks[i]])
        return blocks[:i] + [fresh] + blocks[i + 1 :]

    def fork(self, parent: Request, child: Request) -> bool:
        blocks = list(self._blocks.get(parent.request_id, []))
        self.pool.share([b for b in blocks if b != self.null_block])
        self._blocks[child.request_id] = blocks
        if parent.request_id in self._released:
            self._released[child.request_id] = self._released[parent.request_id]
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_published[child.request_id] = self._num_published.get(parent.request_id, 0)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        blocks = self._blocks.get(request.request_id)
        released = self._released.get(request.request_id, 0)
        if released and released * self.block_size > num_tokens - self.window:  # a query at num_tokens - 1 would see them
            raise RuntimeError(
                f"kv_cache: request {request.request_id} rolled back to {num_tokens} tokens, behind blocks "
                f"already released outside its sliding window of {self.window}; set kv_cache.free_outside_window: false"
            )
        keep = -(-num_tokens // self.block_size)
        if blocks and len(blocks) > keep:
            self.pool.free(blocks[keep:][::-1])
            del blocks[keep:]

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        released = self._released.pop(request.request_id, 0)
        self.pool.free(blocks[released:][::-1])
        self._num_published.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)  # cheap to redo, and its namespace may change (LongRoPE)
        if request.is_finished:
            self._host_free += self._swapped.pop(request.request_id, (0, []))[1]

    # ----------------------------------------------------------------- swap

    def swap_out(self, request: Request) -> bool:
        if not self._host and self._num_host:
            self._host = [self._layer_cache(self._spec, self._num_host, host=True) for _ in self._caches]
            self._host_free = list(range(self._num_host))
        released = self._released.get(request.request_id, 0)
        blocks = self._blocks.get(request.request_id, [])[released:]
        if len(blocks) > len(self._host_free):
            return False
        host = [self._host_free.pop() for _ in blocks]
        self.copy_blocks(BlockCopy("device", tuple(blocks), "host", tuple(host)))
        self.free(request)
        self._swapped[request.request_id] = (released, host)
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        released, host = self._swapped[request.request_id]
        # every swapped block comes back, even one allocated ahead of tokens not yet computed
        needed = max(-(-(request.num_computed_tokens + num_new_tokens) // self.block_size), released + len(host))
        if needed - released > self.pool.num_free:
            return False
        blocks = self.pool.allocate(needed - released)
        self.copy_blocks(BlockCopy("host", tuple(host), "device", tuple(blocks[: len(host)])))
        self._blocks[request.request_id] = [self.null_block] * released + blocks
        if released:
            self._released[request.request_id] = released
        self._host_free += self._swapped.pop(request.request_id)[1]
        return True

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped

    def block_table(self, request: Request) -> list[int]:
        return self._blocks.get(request.request_id, [])

    def cache_blocks(self, request: Request, num_verified_tokens: int) -> None:
        if not self.config.prefix_caching:
            return
        rid = request.request_id
        done = self._num_published.get(rid, 0)
        full = min(num_verified_tokens // self.block_size, len(self._blocks.get(rid, ())))
        if full <= done:
            return
        blocks = self._blocks[rid]
        for i, h in enumerate(self._block_hashes(request, full)[done:], start=done):
            if blocks[i] != self.null_block:  # released before it was published: nothing to publish
                self.pool.cache(blocks[i], h, self._tokens(request, i))
        self._num_published[rid] = full

    def layer_caches(self) -> list[LayerKVCache]:
        return self._caches

    def host_caches(self) -> list[LayerKVCache]:
        return self._host

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()


def release_window(config: PagedConfig, ctx: BuildContext) -> int | None:
    """The window behind which blocks are released, or None to keep every block: the model's
    sliding window when every layer has it and ``free_outside_window`` is not false."""
    model, spec = ctx.model, ctx.kv_spec
    window = model.sliding_window if model is not None else None
    every = window is not None and all(model.layer_window(i) == window for i in range(spec.num_layers))
    if config.free_outside_window is None:
        # a proposer's own KV (ctx.target set) rolls its requests back past earlier allocations
        return window if every and ctx.target is None else None
    if config.free_outside_window and not every:
        why = "has no sliding window" if window is None else "mixes windowed and full-attention layers, which read every position"
        raise ValueError(f"kv_cache.free_outside_window: true needs a sliding window on every layer; this model {why}")
    return window if config.free_outside_window else None


@hookimpl
def register_kv_backends():
    return {"paged": PagedKVBackend}
