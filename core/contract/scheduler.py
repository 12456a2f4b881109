"""Schedulers: which requests run each step and how many tokens each computes."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    from modserve.core.request import Request

@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens of this request computed in this step (prompt chunk, decode, drafts)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler(Plugin):
    """Decides, each step, which requests run and how many tokens each computes.

    The rule (vLLM v1): a request's ``num_computed_tokens`` chases its ``num_tokens``
    (prompt + output + draft tokens). ``schedule`` hands each chosen request a token count
    under the token budget, allocating KV through the backend and preempting when blocks
    run out; it never schedules a request whose blocks it could not allocate.

    Built with ``ctx.kv`` (the KV backend to allocate through) and ``ctx.max_model_len``.
    ``current`` names the request being scheduled while ``schedule`` runs, so a fault inside
    it fails only that request (``None``: the engine fails every request).
    """

    current: Request | None = None

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    def adopt(self, request: Request) -> None:
        """Take in a forked sibling: running if its KV is in place, else waiting to recompute.
        The default queues it like a new request (it resumes from its computed tokens)."""
        self.add_request(request)

    @abstractmethod
    def finish_requests(self, requests: list[Request]) -> None:
        """Remove finished or aborted requests (running or waiting) and free their blocks."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @abstractmethod
    def stats(self) -> SchedulerStats:
        """Queue lengths and running totals, read once per step."""


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int = 0  # since start
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache at admission, since start
    prefix_hits: int = 0  # of those, tokens found

