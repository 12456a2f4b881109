"""Scheduler ``fcfs``: first come, first served continuous batching (the base rule as is)."""

from __future__ import annotations

from modserve.core.contract import hookimpl
from modserve.core.scheduler_base import BaseScheduler

MODSERVE_CONTRACT = "2.0"


class FCFSScheduler(BaseScheduler):
    """Admits in arrival order; preempts the most recently admitted request when blocks run out."""


@hookimpl
def register_schedulers():
    return {"fcfs": FCFSScheduler}
