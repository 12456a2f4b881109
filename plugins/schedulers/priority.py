"""Scheduler ``priority``: lower ``priority`` runs first, ties by arrival (as vLLM orders them).

When a more urgent request cannot get a seat or blocks, the least urgent running request
is preempted. Optional aging (``aging_s``) makes a waiting request one level more urgent
for every ``aging_s`` seconds it has waited, so low priority cannot starve forever.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from modserve.core.contract import hookimpl
from modserve.core.request import Request
from modserve.core.scheduler_base import BaseScheduler, SchedulerConfig

MODSERVE_CONTRACT = "2.0"


class PriorityConfig(SchedulerConfig, kw_only=True):
    aging_s: Annotated[float, msgspec.Meta(gt=0)] | None = None  # one priority level more urgent per aging_s waited


class PriorityScheduler(BaseScheduler):
    Config = PriorityConfig

    def urgency(self, req: Request, now: float) -> tuple[float, float]:
        """Sort key: smaller runs first."""
        prio = float(req.priority)
        if self.config.aging_s:
            prio -= (now - req.metrics.arrival_time) / self.config.aging_s
        return prio, req.metrics.arrival_time

    def next_waiting(self) -> Request | None:
        if not self.waiting:
            return None
        now = time.monotonic()
        return min(self.waiting, key=lambda r: self.urgency(r, now))

    def pick_victim(self, needy: Request) -> Request:
        now = time.monotonic()
        return max(self.running, key=lambda r: self.urgency(r, now))

    def victim_for_admission(self, candidate: Request) -> Request | None:
        if not self.running:
            return None
        now = time.monotonic()
        victim = max(self.running, key=lambda r: self.urgency(r, now))
        return victim if self.urgency(victim, now) > self.urgency(candidate, now) else None


@hookimpl
def register_schedulers():
    return {"priority": PriorityScheduler}
