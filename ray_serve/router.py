"""Ray Serve's request router for the engine replicas: the prefix rule, on Ray's replica ids.

:class:`~modserve.server.prefix_affinity.PrefixAffinity` decides, exactly as in the
single-machine server: the replica that last took the request's prefix key, unless it is much
busier than the least-loaded candidate, else the least-loaded one. A replica's load is the
larger of the engine's own count of requests it holds (``record_routing_stats``, refreshed
every ``ray.routing_stats_period_s``) and Ray's count of requests this router sent it (fresher
between refreshes). Ray then sends to the first choice unless its queue is full, else to the
least loaded of the rest. The key map lives in the ingress replica's process (one map per
ingress replica); entries of a replica that died simply stop matching a candidate.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from modserve.server.prefix_affinity import PrefixAffinity


def _key(pending_request: PendingRequest | None) -> int | None:
    return None if pending_request is None else pending_request.kwargs.get("routing_key")


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, max_entries: int = 4096, **kwargs: Any) -> None:
        self.affinity = PrefixAffinity(block_size=1, max_entries=max_entries)  # keys arrive made

    def load(self, replica: RunningReplica) -> int:
        reported = (replica.routing_stats or {}).get("active")
        sent = self._replica_queue_len_cache.get(replica.replica_id)
        return max(int(reported or 0), int(sent or 0))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        loads = {r.replica_id: self.load(r) for r in candidate_replicas}
        first = self.affinity.choose(_key(pending_request), loads)
        rest = sorted((r for r in candidate_replicas if r.replica_id != first), key=lambda r: loads[r.replica_id])
        ranked = [[next(r for r in candidate_replicas if r.replica_id == first)]]
        return ranked + [rest] if rest else ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.affinity.remember(_key(pending_request), replica_id)
