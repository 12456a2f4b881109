"""Scheduler ``fair_share``: seats in the running batch are shared across users, so one
heavy user's flood cannot starve the others.

FCFS admits in arrival order: a light user's request that arrives behind a heavy user's
backlog waits for the whole backlog. Here the next seat goes to the user with the fewest
running requests, so the light user waits for one seat to free, not for the backlog.

Everything else (the one scheduling rule, chunked prefill, prefix hits, preemption by
recompute) is modserve's :class:`~modserve.core.scheduler_base.BaseScheduler`; this
plugin only overrides two of its policy hooks. Requests without a ``user`` share one
anonymous account.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated

import msgspec

from modserve.core.contract import hookimpl
from modserve.core.request import Request
from modserve.core.scheduler_base import BaseScheduler, SchedulerConfig

MODSERVE_CONTRACT = "2.0"


class FairShareConfig(SchedulerConfig):
    """The base scheduler's options plus a per-user cap."""

    # Most requests one user may have running at once (null: only max_num_seqs limits).
    max_running_per_user: Annotated[int, msgspec.Meta(ge=1)] | None = None


class FairShareScheduler(BaseScheduler):
    """Admits the oldest waiting request of the least-served user; preempts the busiest user's newest."""

    Config = FairShareConfig

    def next_waiting(self) -> Request | None:
        """The oldest waiting request of the user with the fewest running requests.

        Ties go to the user whose oldest waiting request is older (the queue is in arrival
        order, with preempted requests back at its front). Users at the cap are skipped.
        """
        running = Counter(r.user for r in self.running)
        cap = self.config.max_running_per_user
        best: Request | None = None
        seen: set[str | None] = set()
        for req in self.waiting:
            if req.user in seen:
                continue
            seen.add(req.user)
            load = running[req.user]
            if cap is not None and load >= cap:
                continue
            if best is None or load < running[best.user]:
                best = req
                if load == 0:
                    break
        return best

    def pick_victim(self, needy: Request) -> Request:
        """The newest running request of the user holding the most seats gives its blocks back."""
        running = Counter(r.user for r in self.running)
        most = max(running.values())
        return next(r for r in reversed(self.running) if running[r.user] == most)


@hookimpl
def register_schedulers():
    return {"fair_share": FairShareScheduler}
