"""The autoscaling policy: replicas from the engines' own counters, within ``ray.autoscaling``.

Ray's default policy counts calls in flight per replica; an engine's load is better read from
the engine: its running and waiting requests (``active``), and how full its KV cache is, since
a full cache preempts and queues however few requests it holds. Wanted replicas are
``ceil(sum of active / target_active_per_replica)``, plus one while any replica's KV usage is
above ``kv_usage_high``. Ray applies the bounds and the up/down-scale delays around it.
"""

from __future__ import annotations

import math
from typing import Any


class EngineLoadPolicy:
    def __init__(self, target_active_per_replica: int, kv_usage_high: float) -> None:
        self.target = target_active_per_replica
        self.kv_high = kv_usage_high

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        active = metrics.get("active", {})
        kv = metrics.get("kv_usage", {})
        if not active:  # no counters yet (replicas starting): keep what there is
            return ctx.target_num_replicas, {}
        return self.wanted(sum(active.values()), max(kv.values(), default=0.0), ctx.current_num_replicas), {}

    def wanted(self, total_active: float, max_kv_usage: float, current: int) -> int:
        wanted = math.ceil(total_active / self.target) if total_active > 0 else 0
        if max_kv_usage > self.kv_high:
            wanted = max(wanted, current + 1)
        return max(wanted, 1)
