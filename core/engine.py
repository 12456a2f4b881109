"""The engine: one ``step()`` schedules, runs the model once, samples and updates requests.

It reads like DESIGN.md's diagram; every part it calls is a plugin chosen at start-up
(see :mod:`modserve.core.engine_factory`), called directly with no hook dispatch on the
hot path. Observer hooks fire per request and per step.
"""

from __future__ import annotations

import itertools
import random
import time

from modserve.core.engine_factory import EngineComponents, build_components
from modserve.core.interfaces import SchedulerOutput
from modserve.core.output_processor import OutputProcessor
from modserve.core.outputs import RequestOutput
from modserve.core.request import Request, RequestStatus
from modserve.core.sampling_batch import SamplingBatch, fresh_seed
from modserve.core.sampling_params import SamplingParams
from modserve.core.stats import StepStats


class Engine:
    def __init__(self, components: EngineComponents) -> None:
        self.c = components
        self.scheduler = components.scheduler
        self.kv = components.kv
        self.runner = components.runner
        self.sampler = components.sampler
        self.hooks = components.registry.pm.hook
        self.tokenizer = components.tokenizer
        self.max_model_len = components.max_model_len
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(components.tokenizer)
        self._rng = random.Random(components.pipeline.seed)
        self._ids = itertools.count()
        self._step = 0
        self.hooks.on_engine_started(engine_info=components.info())

    @classmethod
    def from_config(cls, source=None, **overrides) -> Engine:
        return cls(build_components(source, **overrides))

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        user: str | None = None,
    ) -> Request:
        """Validate and enqueue one sequence (``n`` is handled by the callers' fan-out)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        self.check_prompt(prompt_token_ids)
        if params.seed is None:
            params = params.with_changes(seed=fresh_seed(self._rng))
        eos = () if params.ignore_eos else tuple(self.c.spec.eos_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, eos, priority, cache_salt, user)
        self.requests[request_id] = req
        self.outputs.add(req)
        self.scheduler.add_request(req)
        self.hooks.on_request_added(request=req)
        return req

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within max_model_len "
                f"{self.max_model_len}"
            )
        vocab = self.c.spec.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_ids: list[str], reason: str = "abort", error: str | None = None) -> list[RequestOutput]:
        """Remove requests now (their blocks return to the pool) and return their final outputs."""
        reqs = [self.requests[r] for r in request_ids if r in self.requests]
        for req in reqs:
            req.finish_reason, req.error = reason, error
        return self._finish(reqs)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        preemptions_before = self.scheduler_preemptions()
        sched = self.scheduler.schedule()
        stats = StepStats(self._step, 0, 0, 0.0, num_scheduled_tokens=sched.num_tokens)
        outputs: list[RequestOutput] = []
        if sched.scheduled:
            batch = self.runner.prepare(sched)
            rows, sampled_reqs = self._sample_rows(sched)
            prompt_rows = self._prompt_logprob_rows(sched)
            t_model = time.perf_counter()
            logits = self.runner.execute(batch, rows + [r for _, _, r in prompt_rows])
            stats.model_time_s = time.perf_counter() - t_model
            if prompt_rows:
                self._record_prompt_logprobs(prompt_rows, logits[len(rows) :])
                logits = logits[: len(rows)]
            counters = [r.num_output_tokens for r in sampled_reqs]
            sampled = self.sampler.sample(logits, SamplingBatch.build(sampled_reqs, counters, self.c.spec.vocab_size, logits.device))
            outputs = self._update(sched, sampled_reqs, sampled, stats)
        self._step += 1
        stats.num_preemptions = self.scheduler_preemptions() - preemptions_before
        stats.num_running, stats.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        stats.kv_usage = self.kv.usage()
        stats.step_time_s = time.perf_counter() - t0
        self.hooks.on_step_finished(stats=stats)
        return outputs

    def scheduler_preemptions(self) -> int:
        return getattr(self.scheduler, "num_preemptions", 0)

    def _sample_rows(self, sched: SchedulerOutput) -> tuple[list[int], list[Request]]:
        """The flat row whose logits give each request's next token (requests that caught up)."""
        rows, reqs, end = [], [], 0
        for s in sched.scheduled:
            end += s.num_tokens
            if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens:
                rows.append(end - 1)
                reqs.append(s.request)
        return rows, reqs

    def _prompt_logprob_rows(self, sched: SchedulerOutput) -> list[tuple[Request, int, int]]:
        """(request, prompt position, flat row) for prompt tokens whose logprobs were asked for.

        The logits at position p score prompt token p + 1."""
        out, start = [], 0
        for s in sched.scheduled:
            req = s.request
            if req.sampling_params.prompt_logprobs is not None:
                first = req.num_computed_tokens
                for p in range(first, min(first + s.num_tokens, req.num_prompt_tokens - 1)):
                    out.append((req, p, start + p - first))
            start += s.num_tokens
        return out

    def _record_prompt_logprobs(self, rows: list[tuple[Request, int, int]], logits) -> None:
        logprobs = logits.log_softmax(dim=-1)
        targets = [req.prompt_token_ids[p + 1] for req, p, _ in rows]
        chosen = logprobs[range(len(rows)), targets].tolist()
        n = max(req.sampling_params.prompt_logprobs for req, _, _ in rows)
        top_lp, top_ids = logprobs.topk(max(n, 1), dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for i, (req, p, _) in enumerate(rows):
            if len(req.prompt_logprobs) == p:  # a recomputed (preempted) prompt is not recorded twice
                k = req.sampling_params.prompt_logprobs
                req.prompt_logprobs.append((chosen[i], list(zip(top_ids[i][:k], top_lp[i][:k]))))

    def _update(self, sched, sampled_reqs, sampled, stats: StepStats) -> list[RequestOutput]:
        for s in sched.scheduled:
            req = s.request
            stats.num_prompt_tokens += max(0, min(req.num_prompt_tokens - req.num_computed_tokens, s.num_tokens))
            req.num_computed_tokens += s.num_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
        token_ids = sampled.token_ids.tolist()
        chosen = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_lp = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
        now = time.monotonic()
        finished, outputs = [], []
        for i, (req, tok) in enumerate(zip(sampled_reqs, token_ids)):
            req.append_output_token(tok)
            stats.num_generation_tokens += 1
            if chosen is not None:
                n = req.sampling_params.logprobs or 0
                top = list(zip(top_ids[i][:n], top_lp[i][:n])) if top_ids is not None else []
                req.logprobs.append((chosen[i], top))
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            self._check_stop(req, tok)
            if self.outputs.process(req, [tok]):
                req.finish_reason = "stop"
            if req.finish_reason is not None:
                finished.append(req)
            else:
                outputs.append(self.outputs.output(req))
        outputs += self._finish(finished)
        stats.finished_request_ids = [r.request_id for r in finished]
        return outputs

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

    def _finish(self, reqs: list[Request]) -> list[RequestOutput]:
        for req in reqs:
            req.status = RequestStatus.FINISHED
        self.scheduler.finish_requests(reqs)
        outputs = []
        for req in reqs:
            req.metrics.finished_time = time.monotonic()
            del self.requests[req.request_id]
            outputs.append(self.outputs.output(req))
            self.hooks.on_request_finished(request=req)
        return outputs
