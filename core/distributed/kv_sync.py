"""Keeps the workers' KV shards in step with rank 0's block moves.

Under tensor parallelism every rank holds KV tensors with the same block ids (its own KV
heads); the block pool runs only on rank 0. Forward passes write the same slots on every
rank by construction, but a KV backend also moves whole blocks outside the forward:
copy-on-write of a block shared by ``n > 1`` siblings, a fork copy, and swap-out /
swap-in for preemption by swap. The contract makes every such move a
:meth:`KVBackend.copy_blocks <modserve.core.contract.KVBackend.copy_blocks>` call, which
tells its listeners: rank 0 records each :class:`~modserve.core.contract.BlockCopy`, sends
the recorded copies with the next step, and each worker replays them on its own shard (and
its own host pool) before that step's forward pass, in the order rank 0 applied them.
Any KV backend that keeps that contract works with ``tensor_parallel_size > 1``.
"""

from __future__ import annotations

import torch

from modserve.core.contract import BlockCopy, KVBackend, LayerKVCache, copy_layer_blocks


class KVCopyRecorder:
    """Records rank 0's block copies until :meth:`take` is called."""

    def __init__(self, kv: KVBackend) -> None:
        self.pending: list[BlockCopy] = []
        self.counts: dict[str, int] = {}  # "device->host": blocks copied so, for tests and stats
        self._open = True
        kv.on_block_copy(self._record)

    def _record(self, copy: BlockCopy) -> None:
        if self._open and copy.src_ids:
            self.pending.append(copy)
            key = f"{copy.src}->{copy.dst}"
            self.counts[key] = self.counts.get(key, 0) + len(copy.src_ids)

    def take(self) -> list[BlockCopy]:
        ops, self.pending = self.pending, []
        return ops

    def close(self) -> None:
        self._open = False


class KVReplica:
    """A worker's side: replays rank 0's copies on this rank's KV shard. The host pool is
    the worker's own (grown to the highest host block id rank 0 used), so it does not
    depend on how the KV backend lays out or lazily creates its host pool."""

    def __init__(self, kv: KVBackend) -> None:
        self.kv = kv
        self.host: list[LayerKVCache] = []

    def _host_for(self, ids: tuple[int, ...]) -> list[LayerKVCache]:
        need, have = max(ids) + 1, (self.host[0].k.shape[0] if self.host else 0)
        if need > have:  # rank 0 hands out host ids from the top: the first swap sizes the pool
            def grown(old: torch.Tensor | None, t: torch.Tensor | None) -> torch.Tensor | None:
                if t is None:
                    return None
                new = torch.zeros((need, *t.shape[1:]), dtype=t.dtype, device="cpu")
                if old is not None:
                    new[:have] = old
                return new

            device = self.kv.layer_caches()
            old = self.host or [LayerKVCache(None, None) for _ in device]  # type: ignore[arg-type]
            self.host = [
                LayerKVCache(grown(o.k, d.k), grown(o.v, d.v), grown(o.k_scale, d.k_scale), grown(o.v_scale, d.v_scale))
                for o, d in zip(old, device)
            ]
        return self.host

    def replay(self, ops: list[BlockCopy]) -> None:
        """Apply rank 0's recorded copies to this rank's KV shard, in order."""
        device = self.kv.layer_caches()
        for op in ops:
            src = device if op.src == "device" else self._host_for(op.src_ids)
            dst = device if op.dst == "device" else self._host_for(op.dst_ids)
            copy_layer_blocks(src, op.src_ids, dst, op.dst_ids)
