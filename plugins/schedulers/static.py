"""Scheduler ``static``: the pre-continuous-batching baseline, for research comparisons.

A batch forms while its members are still in prefill, then runs until every member
finishes; only then may the next batch form. Compare it with ``fcfs`` to measure what
continuous batching buys.
"""

from __future__ import annotations

from modserve.core.contract import hookimpl
from modserve.core.scheduler_base import BaseScheduler

MODSERVE_CONTRACT = "2.0"


class StaticScheduler(BaseScheduler):
    def may_admit(self) -> bool:
        return all(r.num_output_tokens == 0 for r in self.running)


@hookimpl
def register_schedulers():
    return {"static": StaticScheduler}
