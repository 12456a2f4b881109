"""The tensor-parallel process group and the collectives the sharded model calls.

Each engine builds its own group object straight from a ``TCPStore`` (no
``init_process_group``): the process-global default group stays untouched, so one
process can hold several tensor-parallel engines (tests do) and a dead group cannot
poison the next one.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modserve.core.distributed.errors import WorkerDiedError  # noqa: F401 - re-exported
from modserve.core.distributed.sharding import TPShard


def pick_backend(name: str, platform) -> str:
    """``parallel.backend``: ``auto`` is the platform's collective backend."""
    return platform.collective_backend() if name == "auto" else name


@dataclass(eq=False)
class TPGroup(TPShard):
    """A :class:`TPShard` that can talk to its peers once :meth:`connect` has run."""

    pg: Any = None
    store: Any = None

    def connect(self, host: str, port: int, backend: str, timeout_s: float, store=None) -> None:
        """Join the group (blocks until every rank has joined, at most ``timeout_s``)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, self.world_size, is_master=False, timeout=timeout)
        self.store = store
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, timeout)
        elif backend == "nccl":  # not exercised on the CPU-only CI machines
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
        else:
            raise ValueError(f"parallel.backend: unknown backend {backend!r}")

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        self.pg.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([x], opts).wait()
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0 gets ``[R, vocab_size]`` from every rank's ``[R, ceil(V/N)]`` shard; others None."""
        local = local.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.pg.gather([], [local], opts).wait()
            return None
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self.pg.gather([parts], [local], opts).wait()
        return torch.cat(parts, dim=-1)[:, :vocab_size]


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * S, (rank + 1) * S)`` of the embedding (``S = ceil(V / N)``); ids outside
    them look up zeros and the all-reduce sums in the owning rank's row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        size = tp.vocab_shard(vocab_size)
        self.start, self.stop = tp.rank * size, (tp.rank + 1) * size
        self.weight = nn.Parameter(torch.empty(size, hidden_size))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        x = nn.functional.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


def resident_bytes() -> dict[str, int]:
    """This process's resident memory from ``/proc/self/status`` (``rss``, ``rss_anon``), in bytes."""
    out = {}
    try:
        with open(f"/proc/{os.getpid()}/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    out["rss" if key == "VmRSS" else "rss_anon"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def release_free_memory() -> None:
    """Hand memory freed while loading (full tensors, slices, fused copies) back to the OS
    (glibc ``malloc_trim``), so resident memory shows what the shard keeps. No-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: parameters (a tied weight counted once) and weights
    held pre-packed for oneDNN (:mod:`modserve.plugins.platforms.cpu_linear`)."""
    packed = (b for name, b in model.named_buffers() if name.endswith(".packed"))
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *packed))
