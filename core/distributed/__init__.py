"""Tensor parallelism over ``torch.distributed`` (see docs/distributed.md).

``tp`` the process group and collectives, ``sharding`` which slice of each weight a rank
holds, ``worker`` the loop a worker process runs, ``tp_runner`` rank 0's side (starts the
workers, broadcasts each step's batch, watches for dead workers), ``kv_sync`` mirrors
rank 0's KV block copies to the workers.
"""

from modserve.core.distributed.errors import WorkerDiedError

__all__ = ["WorkerDiedError"]
