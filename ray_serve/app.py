"""The Ray Serve application built from a pipeline, and ``modserve ray serve``, which runs it.

Two deployments: ``ingress`` (one replica, no CPU reserved: it only forwards bytes) and
``engine`` (the replicas, each reserving ``ray.num_cpus_per_replica`` CPUs, or one placement
group bundle per tensor-parallel rank, packed on one node). Ray Serve's HTTP proxy listens on
the pipeline's ``server.host`` / ``server.port``.
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import Any

import msgspec

from modserve.core.config import ConfigError, PipelineConfig, RaySection, load_pipeline
from modserve.core.engine_factory import resolve

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
except ImportError:  # pragma: no cover - the message is the behaviour
    ray = None


def require_ray() -> None:
    if ray is None:
        raise RuntimeError("Ray Serve is not installed: pip install 'modserve[ray]'")


def _check_reachable(address: str, flag: str) -> None:
    """Fail at once on a ``host:port`` nobody listens on (``ray.init`` would retry for minutes)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # auto, local, ray://...: Ray's own resolution
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise RuntimeError(f"{flag}: no Ray cluster at {address!r} ({e.strerror or e})") from None


def engine_options(pipeline: PipelineConfig) -> dict[str, Any]:
    """The engine deployment's Ray Serve options, from ``ray:`` (and ``parallel``)."""
    r = pipeline.ray or RaySection()
    tp = pipeline.parallel.tensor_parallel_size
    per_rank: dict[str, float] = {"CPU": r.num_cpus_per_replica}
    if r.num_gpus_per_replica:
        per_rank["GPU"] = r.num_gpus_per_replica
    opts: dict[str, Any] = {
        "name": "engine",
        "max_ongoing_requests": r.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": r.num_cpus_per_replica, "num_gpus": r.num_gpus_per_replica},
        "graceful_shutdown_timeout_s": pipeline.server.shutdown_grace_s,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 60.0,
    }
    if tp > 1:  # the replica's actor takes the first bundle; its rank workers run inside the group's CPUs
        opts["placement_group_bundles"] = [dict(per_rank) for _ in range(tp)]
        opts["placement_group_strategy"] = "STRICT_PACK"
    a = r.autoscaling
    if a is None:
        opts["num_replicas"] = r.num_replicas or 1
    else:
        from modserve.ray_serve.autoscaling import EngineLoadPolicy

        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": a.min_replicas,
            "look_back_period_s": a.look_back_s,
            # Ray still checks its deprecated metrics_interval_s (10 s) against the look-back window
            **({"metrics_interval_s": a.look_back_s / 2} if a.look_back_s <= 10 else {}),
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
            "policy": {
                "policy_function": EngineLoadPolicy,
                "policy_kwargs": {"target_active_per_replica": a.target_active_per_replica, "kv_usage_high": a.kv_usage_high},
            },
        }
    if r.router == "prefix":
        from modserve.ray_serve.router import PrefixAwareRouter

        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAwareRouter, request_routing_stats_period_s=r.routing_stats_period_s,
        )
    return opts


def build_application(source: Any = None, **overrides: Any):
    """The Ray Serve application for a pipeline (validated first, as ``modserve validate`` does)."""
    require_ray()
    from modserve.ray_serve.engine_replica import EngineReplica
    from modserve.ray_serve.ingress import Ingress

    resolved = resolve(source, **overrides)
    pipeline = load_pipeline(source, **overrides)  # as written: each replica resolves `auto` on its own node
    if pipeline.parallel.data_parallel_size > 1:
        raise ConfigError(
            "parallel.data_parallel_size: on Ray Serve the replicas are ray.num_replicas (or ray.autoscaling); "
            "leave data_parallel_size at 1"
        )
    r = pipeline.ray or RaySection()
    block_size = getattr(resolved.plugins["kv_cache"][1], "block_size", 16)
    raw = msgspec.to_builtins(pipeline)
    raw.pop("ray", None)
    threads = max(1, int(r.num_cpus_per_replica))
    engine = serve.deployment(EngineReplica).options(**engine_options(pipeline)).bind(raw, threads)
    ingress = serve.deployment(Ingress).options(
        name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, 4 * r.max_ongoing_requests),
    )
    return ingress.bind(engine, block_size, r.max_retries), pipeline


def run(source: Any = None, address: str | None = None, detach: bool = False, **overrides: Any) -> int:
    """Deploy on the Ray cluster at ``address`` (default ``ray.address``); unless ``detach``,
    serve until SIGINT/SIGTERM, then delete the application."""
    require_ray()
    app, pipeline = build_application(source, **overrides)
    r = pipeline.ray or RaySection()
    where = address or r.address
    _check_reachable(where, "--address" if address else "ray.address")
    try:
        ray.init(address=where, include_dashboard=False, logging_level="WARNING")
    except ConnectionError as e:
        flag = "--address" if address else "ray.address"
        raise RuntimeError(f"{flag}: no Ray cluster at {where!r} ({e})") from None
    serve.start(http_options={"host": pipeline.server.host, "port": pipeline.server.port})
    serve.run(app, name=r.app_name, route_prefix="/", blocking=False)
    host = f"[{pipeline.server.host}]" if ":" in pipeline.server.host else pipeline.server.host
    print(f"modserve: serving {r.app_name!r} on Ray Serve at http://{host}:{pipeline.server.port}/v1", flush=True)
    if detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(r.app_name)
    print(f"modserve: deleted {r.app_name!r}", flush=True)
    return 0
