"""KV-cache backends and eviction policies: who owns the cache tensors and which block goes next."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    import torch

    from modserve.core.contract.build_context import BuildContext
    from modserve.core.request import Request


@dataclass
class KVSpec:
    """What a KV backend must hold: shapes come from the model (this rank's KV heads under
    tensor parallelism), capacity from the backend's own config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


@dataclass
class LayerKVCache:
    """One layer's paged KV storage, shared by the KV backend (owner) and attention (reader/writer).

    ``k`` and ``v`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``. Slot ``s`` is
    row ``s % block_size`` of block ``s // block_size``. When ``k_scale``/``v_scale`` are set
    the cache is quantized (int8) with one float32 scale per token and head
    (``[num_blocks, block_size, num_kv_heads]``): value = int8 * scale.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold this layer's KV, by field name (scales only when quantized)."""
        out = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            out.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return out


@dataclass
class PrefixHit:
    """Blocks already holding a request's leading tokens, found by :meth:`KVBackend.lookup_prefix`."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(frozen=True)
class BlockCopy:
    """Whole blocks copied outside the forward pass: ``"device"`` is the backend's
    :meth:`~KVBackend.layer_caches`, ``"host"`` its :meth:`~KVBackend.host_caches` (swap pool)."""

    src: Literal["device", "host"]
    src_ids: tuple[int, ...]
    dst: Literal["device", "host"]
    dst_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVStats:
    """The KV backend's counters, read once per step (metrics, ``kv_usage``)."""

    num_blocks: int
    num_free_blocks: int

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


def copy_layer_blocks(src: list[LayerKVCache], src_ids, dst: list[LayerKVCache], dst_ids) -> None:
    """Copy whole blocks layer by layer, between device caches or to and from a host pool."""
    import torch

    if not len(src_ids):
        return
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"block copy: {len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    s_idx = torch.tensor(list(src_ids), device=src[0].k.device)
    d_idx = torch.tensor(list(dst_ids), device=dst[0].k.device)
    for s, d in zip(src, dst):
        into = d.tensors()
        for name, t in s.tensors().items():
            into[name].index_copy_(0, d_idx, t.index_select(0, s_idx).to(d_idx.device))


class KVBackend(Plugin):
    """Owns the KV cache tensors and the block pool; maps requests to blocks.

    Built before the attention backend, whose block size is this backend's ``block_size``.
    Allocate cache tensors with ``ctx.platform.allocate_kv`` so a platform plugin decides
    where they live. Subclasses call ``super().__init__(config, ctx)``.

    Invariant the tests check: when no request is in the engine, ``stats().num_free_blocks ==
    num_blocks`` (every block back in the pool after a request ends, aborts or fails).

    Every copy of whole blocks made outside the forward pass (copy-on-write, fork copies,
    swap) goes through :meth:`copy_blocks`: tensor parallelism replays those copies on the
    other ranks' shards, which it learns of through :meth:`on_block_copy`.
    """

    block_size: int
    num_blocks: int

    def __init__(self, config: Any, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self._copy_listeners: list[Callable[[BlockCopy], None]] = []

    @abstractmethod
    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Return the cached blocks covering the request's leading full blocks.

        Never covers the request's last token (it must be recomputed to get logits).
        Has no side effects: the hit only takes effect when passed to :meth:`allocate`.
        A backend without a prefix cache returns an empty ``PrefixHit()``.
        """

    @abstractmethod
    def allocate(self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> bool:
        """Make room for ``request.num_computed_tokens + num_new_tokens`` tokens.

        ``prefix_hit`` is given on a request's first allocation; its blocks are taken
        (ref count +1) and the caller advances ``num_computed_tokens`` past them.
        Returns False and changes nothing when there are not enough free blocks.

        A backend may release blocks no future query can attend when every layer has a
        sliding window ``W`` (those wholly at or before ``num_computed_tokens - W``; the
        ``paged`` backend's ``free_outside_window``). It relies on ``num_computed_tokens``
        never falling below its value at an ``allocate`` call except through :meth:`free`
        (rejected drafts roll back only tokens allocated in the same call); the released
        slots of :meth:`block_table` then hold a placeholder block id whose contents read
        as zeros and are never written, which attention reads, if at all, only at masked
        positions.
        """

    @abstractmethod
    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (cached contents stay reusable)."""

    @abstractmethod
    def block_table(self, request: Request) -> list[int]:
        """The request's block ids in order."""

    @abstractmethod
    def cache_blocks(self, request: Request, num_verified_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_verified_tokens`` tokens
        to the prefix cache. Called after each step with verified tokens only (a backend
        without a prefix cache does nothing)."""

    @abstractmethod
    def layer_caches(self) -> list[LayerKVCache]:
        """Per-layer storage handed to the attention backend."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (including evictable cached blocks)."""

    def stats(self) -> KVStats:
        return KVStats(self.num_blocks, self.num_free_blocks)

    def host_caches(self) -> list[LayerKVCache]:
        """The host-memory swap pool, one entry per layer (empty: no swap)."""
        return []

    def copy_blocks(self, copy: BlockCopy) -> None:
        """Copy whole blocks (see :class:`BlockCopy`) and tell the listeners."""
        side = {"device": self.layer_caches, "host": self.host_caches}
        copy_layer_blocks(side[copy.src](), copy.src_ids, side[copy.dst](), copy.dst_ids)
        for listener in self._copy_listeners:
            listener(copy)

    def on_block_copy(self, listener: Callable[[BlockCopy], None]) -> None:
        """Call ``listener`` after every :meth:`copy_blocks` (tensor parallelism records them)."""
        self._copy_listeners.append(listener)

    def reset_prefix_cache(self) -> None:  # noqa: B027 - optional
        """Forget cached block contents (optional)."""

    def swap_out(self, request: Request) -> bool:
        """Copy the request's KV to host memory and free its device blocks (preemption by
        swap). Returns False, changing nothing, when unsupported or the host pool is full."""
        return False

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request back into fresh device blocks with room for
        ``num_new_tokens`` more. Returns False, changing nothing, without enough free blocks.
        Only called for a request :meth:`is_swapped` says is swapped out."""
        raise NotImplementedError(f"{type(self).__name__} swapped nothing out, so it swaps nothing in")

    def is_swapped(self, request: Request) -> bool:
        return False

    def fork(self, parent: Request, child: Request) -> bool:
        """Give ``child`` the parent's KV (``n > 1`` siblings after the prompt). Paged backends
        share the blocks by ref count and copy a shared block on its first write. Returns
        False (the default) when the child got nothing and must recompute its prompt."""
        return False

    def trim(self, request: Request, num_tokens: int) -> None:  # noqa: B027 - optional
        """Release blocks beyond the first ``num_tokens`` tokens (rejected draft slots)."""


class EvictionPolicy(Plugin):
    """Orders a KV backend's idle blocks: which one is handed out (and its cached
    contents evicted) next. Idle blocks with no cached contents are always taken first.

    The pool calls ``add`` when a block becomes idle (``cached``: its contents are in the
    prefix cache), ``remove`` when a prefix hit takes an idle block back, ``hit`` when a
    cached block is reused by a prefix hit (idle or not), and ``pop`` to pick a block.
    A KV backend builds its policy through ``ctx.registry.create("eviction_policies", ...)``.
    """

    @abstractmethod
    def add(self, block: int, cached: bool) -> None: ...

    @abstractmethod
    def remove(self, block: int) -> None: ...

    @abstractmethod
    def pop(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    def hit(self, block: int) -> None:  # noqa: B027 - optional: frequency-aware policies count hits
        """A prefix hit reused this block."""
