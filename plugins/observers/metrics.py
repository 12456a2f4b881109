"""Prometheus metrics named like vLLM's (prefix ``modserve:``, label ``model_name``).

With data-parallel replicas each replica's observer also carries a ``replica`` label; the
server merges every observer's collectors (``prometheus_collectors``) into one exposition.

Fed only by observer hooks (per request and per step, never per token), so a
third-party plugin can export its own metrics the same way. Each observer owns a
``CollectorRegistry``: several servers in one process do not clash.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from modserve.core.contract import BuildContext, NoOptions, Observer, hookimpl
from modserve.core.request import Request
from modserve.core.contract import StepStats

MODSERVE_CONTRACT = "2.0"

# vLLM's buckets, so dashboards built for it read these the same way
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0]


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's 1-2-5 series)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if m * base > max_model_len:
                return out
            out.append(float(m * base))
        base *= 10


class MetricsObserver(Observer):
    """Observer ``metrics``: its ``CollectorRegistry`` is what ``GET /metrics`` exports."""

    Config = NoOptions

    def __init__(self, config: NoOptions, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        model_name, max_model_len = ctx.model_name, ctx.max_model_len
        replica = str(ctx.replica) if ctx.replica is not None else None
        self.registry = CollectorRegistry()
        self._model_name = model_name
        label = {"model_name": model_name}
        if replica is not None:  # data-parallel replicas: one observer per replica, rendered together
            label["replica"] = replica
        self._label = dict(label)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"modserve:{name}", doc, list(label), registry=self.registry).labels(**label)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"modserve:{name}", doc, list(label), registry=self.registry).labels(**label)

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            metric = Histogram(f"modserve:{name}", doc, list(label), registry=self.registry, buckets=buckets)
            return metric.labels(**label)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests added.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (by recompute or swap).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = Counter(
            "modserve:request_success", "Requests finished, by reason.", [*label, "finished_reason"],
            registry=self.registry,
        )
        self._rejected = Counter(
            "modserve:request_rejected", "Requests refused at admission (503), by reason.",
            [*label, "reason"], registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between a request's consecutive output steps.", ITL_BUCKETS
        )
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft runs verified (one per request per step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_position = Counter(
            "modserve:spec_decode_num_accepted_tokens_per_pos", "Accepted drafts at each draft position.",
            [*label, "position"], registry=self.registry,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets(max_model_len)
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", token_buckets(max_model_len)
        )

    @hookimpl
    def prometheus_collectors(self) -> list[Any]:
        return [self.registry]

    @hookimpl
    def on_request_rejected(self, reason: str) -> None:
        """A request refused before it reached the engine (``overloaded``, ``shutting_down``, ...)."""
        self._rejected.labels(**self._label, reason=reason).inc()

    @hookimpl
    def on_request_added(self, request: Request) -> None:
        self.prompt_tokens.inc(request.num_prompt_tokens)

    @hookimpl
    def on_step_finished(self, stats: StepStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_queries)
        self.prefix_cache_hits.inc(stats.prefix_hits)
        for gap in stats.inter_token_latencies:
            self.itl.observe(gap)
        self.spec_drafts.inc(len(stats.accepted_per_position))
        self.spec_draft_tokens.inc(stats.num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_accepted_tokens)
        for accepted in stats.accepted_per_position:
            for pos in range(accepted):
                self._spec_per_position.labels(**self._label, position=str(pos)).inc()

    @hookimpl
    def on_request_finished(self, request: Request) -> None:
        m = request.metrics
        self._success.labels(**self._label, finished_reason=request.finish_reason or "unknown").inc()
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_output_tokens)
        self.e2e.observe((m.finished_time or m.arrival_time) - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)


@hookimpl
def register_observers():
    return {"metrics": MetricsObserver}
