"""The engine: one ``step()`` schedules, runs the model once, samples and updates requests.

It reads like DESIGN.md's diagram; every part it calls is a plugin chosen at start-up
(see :mod:`modserve.core.engine_factory`), called directly with no hook dispatch on the
hot path. Observer hooks fire per request and per step.
"""

from __future__ import annotations

import itertools
import logging
from contextlib import contextmanager
import random
import time

import torch

from modserve.core.distributed.errors import WorkerDiedError
from modserve.core.engine_factory import EngineComponents, build_components
from modserve.core.fault_isolation import PluginFault, run_isolated
from modserve.core.output_processor import OutputProcessor
from modserve.core.outputs import RequestOutput
from modserve.core.parallel_sampling import Parents, child_params
from modserve.core.models.rope import long_factors_from
from modserve.core.prompt_logprobs import record_prompt_logprobs
from modserve.core.request import Request, RequestStatus
from modserve.core.sample_plan import SamplePlan
from modserve.core.sampling_batch import fresh_seed
from modserve.core.sampling_params import SamplingParams
from modserve.core.contract import LogitsProcessor, SchedulerOutput, SchedulerStats, StepStats
from modserve.core.speculation_governor import SpeculationGovernor
from modserve.core.token_selection import Chosen, select_tokens


log = logging.getLogger("modserve.engine")


def claimed_fields(processors: list[LogitsProcessor]) -> dict[str, LogitsProcessor]:
    """``{request field: processor}``; two processors claiming one field is a start-up error."""
    claimed: dict[str, LogitsProcessor] = {}
    for p in processors:
        if p.request_field in claimed:
            raise ValueError(
                f"logits_processors: {type(claimed[p.request_field]).__name__} and {type(p).__name__} "
                f"both claim the request field {p.request_field!r}; enable one"
            )
        claimed[p.request_field] = p
    return claimed


@contextmanager
def timed(stats: StepStats, field: str):
    """Add the block's wall time to ``stats.<field>`` (where a step's time went)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        setattr(stats, field, getattr(stats, field) + time.perf_counter() - t)


class Engine:
    def __init__(self, components: EngineComponents) -> None:
        self.c = components
        self.scheduler = components.scheduler
        self.kv = components.kv
        self.runner = components.runner
        self.sampler = components.sampler
        self.proposer = components.proposer
        self.governor = SpeculationGovernor(components.proposer.config) if components.proposer else None
        self.hooks = components.registry.pm.hook
        self.processors = claimed_fields(components.logits_processors)
        for observer in components.observers:
            components.registry.pm.register(observer)
        self.faults = PluginFault(components.chosen_plugins())
        self.tokenizer = components.tokenizer
        self.max_model_len = components.max_model_len
        self._long_rope_from = long_factors_from(components.spec.rope_scaling)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(components.tokenizer)
        self.parents = Parents()  # n > 1: a request's sequences, merged back into one output
        self._forks: dict[str, list[Request]] = {}  # n > 1: leader id -> siblings forked after its prompt
        self._rng = random.Random(components.pipeline.seed)
        self._ids = itertools.count()
        self._step = 0
        self.notify("on_engine_started", engine_info=components.info())

    @classmethod
    def from_config(cls, source=None, replica: int | None = None, **overrides) -> Engine:
        return cls(build_components(source, replica=replica, **overrides))

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        user: str | None = None,
    ) -> list[Request]:
        """Validate and enqueue a request (``validate`` then ``enqueue``); returns its sequences."""
        self.validate(prompt_token_ids, params)
        return self.enqueue(prompt_token_ids, params, request_id, priority, cache_salt, user)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the field, for a request the engine cannot take: the one
        check of prompt, stop ids and logits-processor fields. Reads only what is fixed at
        start-up, so the server's event loop calls it before admitting a request."""
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within max_model_len "
                f"{self.max_model_len}"
            )
        vocab = self.c.spec.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        for name in params.processor_fields():
            if name not in self.processors:
                raise ValueError(f"{name}: not supported by this pipeline (no logits processor for it in `logits_processors`)")
            self.processors[name].check(params)

    def enqueue(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        user: str | None = None,
    ) -> list[Request]:
        """Queue a request that :meth:`validate` accepted. ``n > 1`` makes n sequences; only the
        first computes the prompt, the others fork from it (sharing its KV blocks) when its
        prompt is done. Outputs come back per request (:class:`~modserve.core.parallel_sampling.Parents`)."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        ids = self.parents.add(request_id, params.n)
        kv_variant = self._kv_variant(len(prompt_token_ids))
        seqs = []
        for cid, cp in zip(ids, child_params(params)):
            if cp.seed is None:
                cp = cp.with_changes(seed=fresh_seed(self._rng))
            eos = () if cp.ignore_eos else tuple(self.c.spec.eos_token_ids)
            req = Request(cid, list(prompt_token_ids), cp, eos, priority, cache_salt, user, kv_variant, parent_id=request_id)
            self.requests[cid] = req
            self.outputs.add(req)
            seqs.append(req)
        self.scheduler.add_request(seqs[0])
        if len(seqs) > 1:
            self._forks[seqs[0].request_id] = seqs[1:]
        for req in seqs:
            self.notify("on_request_added", request=req)
        return seqs

    def abort_request(self, request_ids: list[str], reason: str = "abort", error: str | None = None) -> list[RequestOutput]:
        """Remove requests now (their blocks return to the pool) and return their final outputs.
        A request id stands for all its sequences; a sequence id (``id#i``) for that one."""
        return self.parents.merge(self._abort(self.parents.sequences(request_ids), reason, error))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def capture_graphs(self) -> None:
        """Capture every graph size the runner replays, before the first request: a server's
        first clients would otherwise wait for the captures (on one H100 a cold SmolLM2 server
        gave 64 clients 2,224 out tok/s and a p99 TTFT of 1.4 s, a warm one 3,794 and 0.25 s)."""
        t = time.perf_counter()
        done = self.runner.capture_graphs()
        if done:
            log.info("graphs captured at start-up: %s in %.1f s", done, time.perf_counter() - t)

    @property
    def dead(self) -> str | None:
        """Why this engine can never step again (a tensor-parallel worker died: the message
        names the rank), else None. Cheap: polls the worker processes."""
        return self.runner.dead

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (also done when the engine is garbage-collected
        or the interpreter exits) and close the observers. Idempotent."""
        self.runner.shutdown()
        for observer in self.c.observers:
            if self.c.registry.pm.is_registered(observer):
                self.c.registry.pm.unregister(observer)
                observer.close()

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, update: DESIGN.md's diagram. A plugin that
        raises fails only the requests it touched (``_fail``); a dead worker group ends it all."""
        t0 = time.perf_counter()
        if self.dead is not None:
            self._die(WorkerDiedError(self.dead))
        before = self.scheduler.stats()
        stats = StepStats(self._step, 0, 0, 0.0)
        try:
            with timed(stats, "schedule_time_s"):
                sched = self.scheduler.schedule()
        except Exception as e:  # the scheduler, or the KV backend it called
            current = self.scheduler.current
            return self.parents.merge(self._fail(e, "scheduler", [current] if current is not None else list(self.requests.values())))
        stats.num_scheduled_tokens = sched.num_tokens
        outputs: list[RequestOutput] = []
        if sched.scheduled:
            try:
                plan, logits = self._run(sched, stats)
            except WorkerDiedError as e:  # tensor parallelism: the worker group is gone for good
                self._die(e)
            except Exception as e:  # attention or KV plugin inside the forward: the batch is lost
                return self.parents.merge(self._fail(e, "model forward", [s.request for s in sched.scheduled]))
            with timed(stats, "sample_time_s"):
                chosen, failed = self._select(logits, plan, sched)
            with timed(stats, "output_time_s"):
                outputs = self._update(sched, plan, chosen, stats) + failed
                outputs += self._propose_drafts([e.request for e in plan.entries if e.request.finish_reason is None])
        self._end_step(stats, before, t0)
        return self.parents.merge(outputs)

    # ----------------------------------------------------------------- internals

    def _run(self, sched: SchedulerOutput, stats: StepStats) -> tuple[SamplePlan, torch.Tensor]:
        """Flatten the scheduled tokens into one batch and run the model: logits of the sampled rows."""
        with timed(stats, "prepare_time_s"):
            batch = self.runner.prepare(sched)
            plan = SamplePlan.build(sched, self._forks)
        with timed(stats, "model_time_s"):
            logits = self.runner.execute(batch, plan.rows)
        if plan.prompt_rows:
            record_prompt_logprobs(plan.prompt_rows, logits[plan.num_sample_rows :])
        return plan, logits

    def _end_step(self, stats: StepStats, before: SchedulerStats, t0: float) -> None:
        self._step += 1
        after = self.scheduler.stats()
        stats.num_preemptions = after.num_preemptions - before.num_preemptions
        stats.prefix_queries = after.prefix_queries - before.prefix_queries
        stats.prefix_hits = after.prefix_hits - before.prefix_hits
        stats.num_running, stats.num_waiting = after.num_running, after.num_waiting
        stats.kv_usage = self.kv.stats().usage
        stats.step_time_s = time.perf_counter() - t0
        self.notify("on_step_finished", stats=stats)

    def notify(self, hook: str, **kwargs) -> None:
        """Call every observer of ``hook``; one that raises is logged and the rest still run."""
        for impl in getattr(self.hooks, hook).get_hookimpls():  # pluggy's hook relay
            try:
                impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception:
                log.exception("observer %s failed in %s", impl.plugin_name, hook)

    def _update(self, sched, plan: SamplePlan, chosen: list[Chosen], stats: StepStats) -> list[RequestOutput]:
        for s in sched.scheduled:
            req = s.request
            stats.num_prompt_tokens += max(0, min(req.num_prompt_tokens - req.num_computed_tokens, s.num_tokens))
            req.num_computed_tokens += s.num_tokens
        now = time.monotonic()
        finished, outputs = [], []
        for entry, ch in zip(plan.entries, chosen):
            req = entry.request
            if entry.fork_of is not None:  # an n > 1 sibling takes its leader's prompt KV
                leader = entry.fork_of
                req.num_computed_tokens = leader.num_computed_tokens if self.kv.fork(leader, req) else 0
                self.scheduler.adopt(req)
            req.num_computed_tokens -= ch.num_drafts - ch.num_accepted  # roll back rejected drafts
            req.spec_token_ids = []
            if ch.num_drafts:
                self.kv.trim(req, req.num_computed_tokens + 1)
                stats.num_draft_tokens += ch.num_drafts
                stats.num_accepted_tokens += ch.num_accepted
                stats.accepted_per_position.append(ch.num_accepted)
            for i, tok in enumerate(ch.tokens):
                if i and self._kv_variant(req.num_tokens) != req.kv_variant:
                    break  # accepted drafts past a LongRoPE switch were scored on K/V rotated the old way
                req.append_output_token(tok)
                stats.num_generation_tokens += 1
                if ch.logprobs is not None:
                    req.logprobs.append(ch.logprobs[i])
                self._check_stop(req, tok)
                if self.outputs.process(req, [tok]):
                    req.finish_reason = "stop"
                if req.finish_reason is not None:
                    break
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            else:
                stats.inter_token_latencies.append(now - req.metrics.last_token_time)
            req.metrics.last_token_time = now
            (finished if req.finish_reason is not None else outputs).append(req)
            if req.finish_reason is None and self._kv_variant(req.num_tokens) != req.kv_variant:
                self._recompute(req)
        for leader in {e.request.request_id for e in plan.entries} & self._forks.keys():
            del self._forks[leader]
        for s in sched.scheduled:
            self.kv.cache_blocks(s.request, s.request.num_computed_tokens)
        if self.governor is not None:
            self.governor.record(stats.num_draft_tokens, stats.num_accepted_tokens)
        stats.finished_request_ids = [r.request_id for r in finished]
        return [self.outputs.output(r) for r in outputs] + self._finish(finished)

    def _kv_variant(self, num_tokens: int) -> str:
        """What besides the tokens sets a sequence's K/V at this length (``Request.kv_variant``)."""
        return "long-rope" if self._long_rope_from is not None and num_tokens > self._long_rope_from else ""

    def _recompute(self, req: Request) -> None:
        """Drop a running request's K/V to compute it again under its new variant: HF's Phi-3
        recomputes its cache with the long factors when generation passes the original length."""
        req.kv_variant = self._kv_variant(req.num_tokens)
        self.kv.free(req)
        req.num_computed_tokens = 0

    def _check_stop(self, req: Request, tok: int) -> None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if tok in req.eos_token_ids:
                req.finish_reason = "stop"
                return
            if tok in sp.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", tok
                return
        if (sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens) or req.num_tokens >= self.max_model_len:
            req.finish_reason = "length"

    def _select(self, logits, plan: SamplePlan, sched) -> tuple[list[Chosen], list[RequestOutput]]:
        """Sampler plugin call, isolated per request: entries whose sampling raises fail alone
        and leave this step's plan and schedule before the update."""
        offsets = plan.sample_offsets()

        def choose(entries):
            first, end = offsets[id(entries[0])], offsets[id(entries[-1])] + len(entries[-1].rows)
            if end - first == sum(len(e.rows) for e in entries):  # one run in order (all, or one): a view
                rows = logits[first:end]
            else:
                rows = torch.cat([logits[offsets[id(e)] : offsets[id(e)] + len(e.rows)] for e in entries])
            return select_tokens(self.sampler, rows, entries, self.c.spec.vocab_size, self.processors)

        chosen, faults = run_isolated(choose, plan.entries)
        if not faults:
            return chosen, []
        bad = {e.request.request_id for e, _ in faults}
        kept = [(e, c) for e, c in zip(plan.entries, chosen) if c is not None]  # may be none: all failed
        plan.entries, chosen = [e for e, _ in kept], [c for _, c in kept]
        sched.scheduled = [s for s in sched.scheduled if s.request.request_id not in bad]
        return chosen, [o for e, exc in faults for o in self._fail(exc, "sampler", [e.request])]

    def _propose_drafts(self, decoding: list[Request]) -> list[RequestOutput]:
        """Ask the proposer for the next step's draft tokens (speculative decoding); a request
        whose proposal raises fails alone. Returns the outputs of failed requests."""
        if self.proposer is None or not self.governor.should_propose(self.scheduler.stats().num_running):
            return []
        k = self.proposer.config.num_speculative_tokens
        eligible = [r for r in decoding if r.sampling_params.speculative and not r.sampling_params.needs_penalties]
        if not eligible:
            return []
        proposals, faults = run_isolated(lambda reqs: self.proposer.propose(reqs, k), eligible)
        for req, drafts in zip(eligible, proposals):
            sp = req.sampling_params
            room = self.max_model_len - req.num_tokens - 1
            if sp.max_tokens is not None:
                room = min(room, sp.max_tokens - req.num_output_tokens - 1)
            req.spec_token_ids = list((drafts or [])[: max(0, min(k, room))])
        return [o for req, exc in faults for o in self._fail(exc, "speculative decoder", [req])]

    def _die(self, exc: WorkerDiedError) -> None:
        """Stop what is left of the worker group, fail every request still in the engine (the
        outputs ride on ``exc``), then raise."""
        self.shutdown()
        exc.outputs = self.abort_request(list(self.requests), reason="error", error=str(exc))
        raise exc

    def _fail(self, exc: Exception, stage: str, requests: list[Request]) -> list[RequestOutput]:
        """Fail the requests a plugin touched when it raised; everyone else keeps going."""
        message = self.faults.describe(exc, stage)
        ids = list(dict.fromkeys(r.request_id for r in requests if r.request_id in self.requests))
        return self._abort(ids, reason="error", error=message)

    def _abort(self, seq_ids: list[str], reason: str, error: str | None) -> list[RequestOutput]:
        """Finish these sequences now (and a leader's siblings that have not forked yet); their
        sequence outputs, for :meth:`Parents.merge`."""
        reqs = [self.requests[r] for r in seq_ids if r in self.requests]
        reqs += [s for r in reqs for s in self._forks.pop(r.request_id, ()) if s not in reqs]
        for siblings in self._forks.values():
            siblings[:] = [s for s in siblings if s not in reqs]
        for req in reqs:
            req.finish_reason, req.error = reason, error
        return self._finish(reqs)

    def _finish(self, reqs: list[Request]) -> list[RequestOutput]:
        for req in reqs:
            req.status = RequestStatus.FINISHED
        self.scheduler.finish_requests(reqs)
        outputs = []
        for req in reqs:
            req.metrics.finished_time = time.monotonic()
            del self.requests[req.request_id]
            if self.proposer is not None:
                self.proposer.release(req)
            for name in req.processor_fields:
                self.processors[name].release(req)
            outputs.append(self.outputs.output(req))
            self.notify("on_request_finished", request=req)
        return outputs
