"""The one scheduling rule, shared by the shipped schedulers; policies override small hooks.

Each step: every running request gets ``num_tokens_with_spec - num_computed_tokens``
tokens (capped by the budget and ``long_prefill_token_threshold``), in running order;
then waiting requests are admitted while seats, budget and blocks last. Chunked prefill,
prefix hits, decodes and draft tokens all fall out of that rule. When a running request
cannot get blocks, the policy's victim is preempted: by recompute (its blocks freed, its
progress reset, queued at the front; prefix caching usually brings it back) or by swap
(its KV copied to host memory and copied back when it resumes).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Annotated, Literal

import msgspec

from modserve.core.contract import (
    BuildContext,
    PrefixHit,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
)
from modserve.core.request import Request, RequestStatus


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 64  # requests running at once
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 2048  # token budget of one step
    enable_chunked_prefill: bool = True  # split long prompts across steps
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: no cap
    preemption_mode: Literal["recompute", "swap"] = "recompute"  # what happens to a victim's KV
    admission_watermark: Annotated[float, msgspec.Meta(ge=0, le=0.5)] = 0.01  # free-block share kept for running requests


class BaseScheduler(Scheduler):
    Config = SchedulerConfig

    def __init__(self, config: SchedulerConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.kv = ctx.kv
        self.max_model_len = ctx.max_model_len
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of those, found in the prefix cache
        self.current: Request | None = None  # the request being scheduled (named if a plugin raises)

    # ----------------------------------------------------------------- policy hooks

    def enqueue(self, request: Request, front: bool = False) -> None:
        """Put a request in the waiting queue (front: a preempted request resumes first)."""
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def next_waiting(self) -> Request | None:
        return self.waiting[0] if self.waiting else None

    def pick_victim(self, needy: Request) -> Request:
        """The running request to preempt so that ``needy`` can grow (FCFS: the newest)."""
        return self.running[-1]

    def may_admit(self) -> bool:
        """Whether waiting requests may join this step (a static batcher says no while busy)."""
        return True

    def victim_for_admission(self, candidate: Request) -> Request | None:
        """A running request to preempt so that ``candidate`` can be admitted (FCFS: none)."""
        return None

    # ----------------------------------------------------------------- Scheduler

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.enqueue(request)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions, self.prefix_queries, self.prefix_hits)

    def adopt(self, request: Request) -> None:
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
        if request.num_computed_tokens:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            request.status = RequestStatus.WAITING
            self.enqueue(request, front=True)

    def finish_requests(self, requests: list[Request]) -> None:
        for req in requests:
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.kv.free(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.current = self.running[i]
            n = self._token_count(req, req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.pick_victim(req)
                budget += self._preempt(victim, scheduled, out)
                if victim is req:
                    break
                if self.running.index(req) < i:  # a victim before req shifted the list
                    i -= 1
            else:
                scheduled[req.request_id] = ScheduledRequest(req, n)
                budget -= n
                i += 1
        if not out.preempted and self.may_admit():
            budget = self._admit(budget, scheduled, out)
        out.scheduled = list(scheduled.values())
        self.current = None
        return out

    # ----------------------------------------------------------------- internals

    def _token_count(self, req: Request, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _admit(self, budget: int, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput) -> int:
        while budget > 0:
            req = self.current = self.next_waiting()
            if req is None:
                break
            if self.running and self.kv.num_free_blocks < self.config.admission_watermark * self.kv.num_blocks:
                break  # leave running requests room to grow rather than preempt them soon
            if len(self.running) >= self.config.max_num_seqs:
                victim = self.victim_for_admission(req)
                if victim is None:
                    break
                budget += self._preempt(victim, scheduled, out)
                continue
            hit = PrefixHit()
            swapped = self.kv.is_swapped(req)
            if req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None:
                hit = self.kv.lookup_prefix(req)  # prompt logprobs need every prompt position computed
            remaining = req.num_tokens - req.num_computed_tokens - hit.num_tokens
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = self._token_count(req, remaining, budget)
            if not (self.kv.swap_in(req, n) if swapped else self.kv.allocate(req, n, hit)):
                victim = self.victim_for_admission(req)
                if victim is None:
                    break
                budget += self._preempt(victim, scheduled, out)
                continue
            self.waiting.remove(req)
            self._record_admission(req, hit)
            req.num_computed_tokens += hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, n)
            budget -= n
        return budget

    def _record_admission(self, req: Request, hit: PrefixHit) -> None:
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit.num_tokens
        self.prefix_queries += req.num_tokens
        self.prefix_hits += hit.num_tokens

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput) -> int:
        """Free the victim's blocks and requeue it at the front; returns budget it gave back."""
        self.running.remove(victim)
        victim.spec_token_ids = []
        if not (self.config.preemption_mode == "swap" and self.kv.swap_out(victim)):
            self.kv.free(victim)  # recompute: the prefix cache usually brings most of it back
            victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.num_preemptions += 1
        out.preempted.append(victim)
        self.enqueue(victim, front=True)
        refunded = scheduled.pop(victim.request_id, None)
        return refunded.num_tokens if refunded else 0
