"""Keeps the workers' KV shards in step with rank 0's block moves.

Under tensor parallelism every rank holds KV tensors with the same block ids (its own KV
heads); the block pool runs only on rank 0. Forward passes write the same slots on every
rank by construction, but a KV backend also moves whole blocks outside the forward:
copy-on-write of a block shared by ``n > 1`` siblings, the ``contiguous`` backend's fork
copy, and swap-out / swap-in for preemption by swap. Those go through
``modserve.plugins.kv_backends.paged._copy_blocks``; this module wraps that function so a
copy touching a tensor-parallel engine's caches is also recorded as
``(src, src_ids, dst, dst_ids)`` with ``src``/``dst`` one of ``"device"`` (the backend's
``layer_caches()``) or ``"host"`` (its swap pool). Rank 0 sends the recorded copies with
the next step and each worker replays them on its own shard (and its own host pool)
before that step's forward pass, in the order rank 0 applied them.

Only KV backends that are (subclasses of) the built-in ``paged`` backend are accepted
with ``tensor_parallel_size > 1``: another backend's block moves would be invisible here.
"""

from __future__ import annotations

import weakref

import torch

from modserve.core.interfaces import LayerKVCache
from modserve.plugins.kv_backends import contiguous, paged

_recorders: weakref.WeakSet[KVCopyRecorder] = weakref.WeakSet()
_original_copy = paged._copy_blocks


def _recording_copy_blocks(src, src_ids, dst, dst_ids) -> None:
    _original_copy(src, src_ids, dst, dst_ids)
    for recorder in list(_recorders):
        recorder.observe(src, src_ids, dst, dst_ids)


def _install() -> None:
    if paged._copy_blocks is not _recording_copy_blocks:
        paged._copy_blocks = _recording_copy_blocks
        contiguous._copy_blocks = _recording_copy_blocks


def supports(kv) -> bool:
    return isinstance(kv, paged.PagedKVBackend)


class KVCopyRecorder:
    """Records the block copies of rank 0's KV backend ``kv`` until :meth:`take` is called.

    A copy is ours when one side is ``kv.layer_caches()`` (compared by the first layer's
    tensor); the other side is then either those caches again or the backend's host pool.
    """

    def __init__(self, kv) -> None:
        _install()
        self._kv = weakref.ref(kv)
        self.pending: list[tuple[str, list[int], str, list[int]]] = []
        self.counts: dict[str, int] = {}  # "device->host": blocks copied so, for tests and stats
        _recorders.add(self)

    def _is_device(self, caches) -> bool:
        kv = self._kv()
        return kv is not None and len(caches) > 0 and caches[0].k is kv.layer_caches()[0].k

    def observe(self, src, src_ids, dst, dst_ids) -> None:
        s, d = self._is_device(src), self._is_device(dst)
        if (s or d) and len(src_ids):
            s, d = "device" if s else "host", "device" if d else "host"
            self.pending.append((s, [int(i) for i in src_ids], d, [int(i) for i in dst_ids]))
            self.counts[f"{s}->{d}"] = self.counts.get(f"{s}->{d}", 0) + len(src_ids)

    def take(self) -> list[tuple[str, list[int], str, list[int]]]:
        ops, self.pending = self.pending, []
        return ops

    def close(self) -> None:
        _recorders.discard(self)


class KVReplica:
    """A worker's side: replays rank 0's copies on this rank's KV shard. The host pool is
    the worker's own (grown to the highest host block id rank 0 used), so it does not
    depend on how the KV backend lays out or lazily creates its host pool."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self.host: list[LayerKVCache] = []

    def _host_for(self, ids: list[int]) -> list[LayerKVCache]:
        need, have = max(ids) + 1, (self.host[0].k.shape[0] if self.host else 0)
        if need > have:  # rank 0 hands out host ids from the top: the first swap sizes the pool
            def grown(old, t):
                if t is None:
                    return None
                new = torch.zeros((need, *t.shape[1:]), dtype=t.dtype, device="cpu")
                if old is not None:
                    new[:have] = old
                return new

            old = self.host or [None] * len(self.kv.layer_caches())
            self.host = [
                LayerKVCache(*(grown(getattr(o, n) if o is not None else None, getattr(d, n)) for n in ("k", "v", "k_scale", "v_scale")))
                for o, d in zip(old, self.kv.layer_caches())
            ]
        return self.host

    def replay(self, ops: list[tuple[str, list[int], str, list[int]]]) -> None:
        """Apply rank 0's recorded copies to this rank's KV shard, in order."""
        device = self.kv.layer_caches()
        for src, src_ids, dst, dst_ids in ops:
            s = device if src == "device" else self._host_for(src_ids)
            d = device if dst == "device" else self._host_for(dst_ids)
            _original_copy(s, src_ids, d, dst_ids)
