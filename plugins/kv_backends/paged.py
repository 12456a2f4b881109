"""KV backend ``paged``: block tables over one preallocated tensor per layer, with prefix caching.

Capacity is ``num_blocks`` or a ``memory_gb`` budget. ``kv_dtype: int8`` stores K/V as
int8 with a float32 scale per token and head (quantized on write by the attention
backend), so the same budget holds about 3.8x as many fp32 blocks.
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
        if config.num_blocks is not None:
            self.num_blocks = config.num_blocks
        else:
            budget = (config.memory_gb or 1.0) * 2**30
            self.num_blocks = int(budget // bytes_per_block(config, spec))
        if self.num_blocks * self.block_size < spec.max_model_len:
            raise ValueError(
                f"kv_cache: {self.num_blocks} blocks of {self.block_size} tokens hold "
                f"{self.num_blocks * self.block_size} tokens, fewer than max_model_len {spec.max_model_len}; "
                "raise num_blocks/memory_gb or lower model.max_model_len"
            )
        self.pool = BlockPool(self.num_blocks, ctx.registry.create("kv_cache.eviction", config.eviction, ctx))
        self._platform = ctx.platform
        self._caches = [self._layer_cache(spec, self.num_blocks) for _ in range(spec.num_layers)]
        self._spec = spec
        self._num_host = int(config.swap_space_gb * 2**30 // bytes_per_block(config, spec))
        self._host: list[LayerKVCache] = []  # host pool and its free list: made on the first swap-out
        self._host_free: list[int] = []
        self._swapped: dict[str, list[int]] = {}
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
            h.update(hashes[-1] if hashes else (request.cache_salt or "").encode())
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
        blocks = self._blocks.get(request.request_id, [])
        hit = prefix_hit or PrefixHit()
        needed_tokens = request.num_computed_tokens + hit.num_tokens + num_new_tokens
        num_new_blocks = -(-needed_tokens // self.block_size) - len(blocks) - len(hit.block_ids)
        idle_hits = sum(1 for b in hit.block_ids if self.pool.ref_cnt[b] == 0)
        shared = self._shared_write_block(request, blocks)
        if max(num_new_blocks, 0) + (shared is not None) > self.pool.num_free - idle_hits:
            return False
        if shared is not None:
            blocks = self._copy_on_write(blocks, shared)
        if hit.block_ids:
            self.pool.touch(hit.block_ids)
            blocks = blocks + hit.block_ids
            self._num_published[request.request_id] = len(hit.block_ids)
        if num_new_blocks > 0:
            blocks = blocks + self.pool.allocate(num_new_blocks)
        self._blocks[request.request_id] = blocks
        return True

    def _shared_write_block(self, request: Request, blocks: list[int]) -> int | None:
        """Index of the block the next write lands in, if another sequence shares it."""
        i = request.num_computed_tokens // self.block_size
        if i < len(blocks) and self.pool.ref_cnt[blocks[i]] > 1:
            return i
        return None

    def _copy_on_write(self, blocks: list[int], i: int) -> list[int]:
        (fresh,) = self.pool.allocate(1)
        self.copy_blocks(BlockCopy("device", (blocks[i],), "device", (fresh,)))
        self.pool.free([blocks[i]])
        return blocks[:i] + [fresh] + blocks[i + 1 :]

    def fork(self, parent: Request, child: Request) -> bool:
        blocks = list(self._blocks.get(parent.request_id, []))
        self.pool.share(blocks)
        self._blocks[child.request_id] = blocks
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_published[child.request_id] = self._num_published.get(parent.request_id, 0)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        blocks = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks and len(blocks) > keep:
            self.pool.free(blocks[keep:][::-1])
            del blocks[keep:]

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self.pool.free(blocks[::-1])
        self._num_published.pop(request.request_id, None)
        if request.is_finished:
            self._hashes.pop(request.request_id, None)
            self._host_free += self._swapped.pop(request.request_id, [])

    # ----------------------------------------------------------------- swap

    def swap_out(self, request: Request) -> bool:
        if not self._host and self._num_host:
            self._host = [self._layer_cache(self._spec, self._num_host, host=True) for _ in self._caches]
            self._host_free = list(range(self._num_host))
        blocks = self._blocks.get(request.request_id, [])
        if len(blocks) > len(self._host_free):
            return False
        host = [self._host_free.pop() for _ in blocks]
        self.copy_blocks(BlockCopy("device", tuple(blocks), "host", tuple(host)))
        self.free(request)
        self._swapped[request.request_id] = host
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        host = self._swapped[request.request_id]
        # every swapped block comes back, even one allocated ahead of tokens not yet computed
        needed = max(-(-(request.num_computed_tokens + num_new_tokens) // self.block_size), len(host))
        if needed > self.pool.num_free:
            return False
        blocks = self.pool.allocate(needed)
        self.copy_blocks(BlockCopy("host", tuple(host), "device", tuple(blocks[: len(host)])))
        self._blocks[request.request_id] = blocks
        self._host_free += self._swapped.pop(request.request_id)
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


@hookimpl
def register_kv_backends():
    return {"paged": PagedKVBackend}
