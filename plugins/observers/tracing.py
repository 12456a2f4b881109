"""OpenTelemetry traces: one span per engine request with ``gen_ai.*`` attributes.

The span is recorded when the request finishes (``on_request_finished``) from the
timestamps the engine kept, so tracing costs nothing per token or per step. Events mark
queueing, scheduling, the first token and the finish. The server attaches the incoming
``traceparent`` (W3C trace context) before submitting, so the span joins the caller's
trace. Each observer has its own ``TracerProvider``: no global state is touched.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from typing import Literal

import msgspec

from modserve.core.config import ConfigError
from modserve.core.contract import BuildContext, Observer, hookimpl
from modserve.core.request import Request

MODSERVE_CONTRACT = "2.0"

_PROPAGATOR = TraceContextTextMapPropagator()


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    exporter: Literal["console", "otlp"] = "console"  # console: spans printed as JSON; otlp: sent over OTLP/HTTP
    endpoint: str | None = None  # the OTLP collector's URL (default: the exporter's, or OTEL_EXPORTER_OTLP_ENDPOINT)


def make_exporter(cfg: TracingConfig) -> SpanExporter:
    """The exporter the observer's config asks for."""
    if cfg.exporter == "console":
        return ConsoleSpanExporter()
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            "tracing.exporter: 'otlp' needs the package opentelemetry-exporter-otlp-proto-http "
            "(pip install opentelemetry-exporter-otlp-proto-http)"
        ) from None
    return OTLPSpanExporter(endpoint=cfg.endpoint) if cfg.endpoint else OTLPSpanExporter()


class TracingObserver(Observer):
    """Observer ``tracing``: the caller's trace context arrives with ``on_request_received``."""

    Config = TracingConfig

    @classmethod
    def check_config(cls, config: TracingConfig, registry) -> None:
        if config.exporter == "otlp":
            make_exporter(config)  # the exporter's package must be installed

    def __init__(self, config: TracingConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        exporter, batch = make_exporter(config), config.exporter != "console"
        self.model_name = ctx.model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": "modserve"}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("modserve")
        self._pending: dict[str, tuple[Context, dict[str, Any], int]] = {}  # request id -> (context, attributes, open sequences)

    @hookimpl
    def on_request_received(self, request_id: str, headers: Mapping[str, str], operation: str, response_id: str) -> None:
        """Remember the caller's trace context and the API operation for this engine request."""
        ctx = _PROPAGATOR.extract(carrier=headers)
        self._pending[request_id] = (ctx, {"gen_ai.operation.name": operation, "gen_ai.response.id": response_id}, 0)

    @hookimpl
    def on_request_added(self, request: Request) -> None:
        """Count the request's sequences, so its context goes once the last one has finished."""
        pending = self._pending.get(request.parent_id)
        if pending is not None:
            self._pending[request.parent_id] = (*pending[:2], pending[2] + 1)

    def close(self) -> None:
        self.provider.shutdown()

    @hookimpl
    def on_request_finished(self, request: Request) -> None:
        ctx, extra, open_sequences = self._pending.get(request.parent_id, (None, {}, 0))
        if open_sequences <= 1:
            self._pending.pop(request.parent_id, None)
        else:
            self._pending[request.parent_id] = (ctx, extra, open_sequences - 1)
        m, sp = request.metrics, request.sampling_params
        to_ns = _clock()
        operation = extra.get("gen_ai.operation.name", "generate")
        attrs: dict[str, Any] = {
            "gen_ai.system": "modserve",
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.temperature": sp.temperature,
            "gen_ai.request.top_p": sp.top_p,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            "gen_ai.usage.output_tokens": request.num_output_tokens,
            "gen_ai.response.finish_reasons": [request.finish_reason or "unknown"],
            "modserve.request_id": request.request_id,
            "modserve.cached_tokens": max(request.num_cached_tokens, 0),
            "modserve.num_preemptions": request.num_preemptions,
            **extra,
        }
        if sp.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = sp.max_tokens
        if sp.seed is not None:
            attrs["gen_ai.request.seed"] = sp.seed
        span = self.tracer.start_span(
            f"{operation} {self.model_name}", context=ctx, kind=trace.SpanKind.SERVER,
            attributes=attrs, start_time=to_ns(m.arrival_time),
        )
        span.add_event("queued", timestamp=to_ns(m.arrival_time))
        if m.first_scheduled_time is not None:
            span.add_event("scheduled", {"gen_ai.latency.time_in_queue": m.first_scheduled_time - m.arrival_time},
                           timestamp=to_ns(m.first_scheduled_time))
        if m.first_token_time is not None:
            span.add_event("first_token", {"gen_ai.latency.time_to_first_token": m.first_token_time - m.arrival_time},
                           timestamp=to_ns(m.first_token_time))
        end = m.finished_time or time.monotonic()
        span.add_event("finished", {"finish_reason": request.finish_reason or "unknown"}, timestamp=to_ns(end))
        if request.finish_reason == "error":
            span.set_status(trace.Status(trace.StatusCode.ERROR, request.error or "error"))
        span.end(end_time=to_ns(end))


def _clock():
    """Maps the engine's ``time.monotonic`` stamps to epoch nanoseconds."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset


@hookimpl
def register_observers():
    return {"tracing": TracingObserver}
