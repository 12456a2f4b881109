"""The OpenAI-compatible server: ``build_app`` (the ASGI app, for tests) and ``serve`` (the CLI's)."""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware

from modserve.core.async_engine import AsyncEngine
from modserve.core.config import ConfigError, api_keys
from modserve.core.engine import Engine
from modserve.core.engine_factory import resolve
from modserve.server.access_log import AccessLogMiddleware
from modserve.server.auth import AuthMiddleware
from modserve.server.errors import EXCEPTION_HANDLERS
from modserve.server.lifecycle import Runner, bind
from modserve.server.router import ReplicaHeaderMiddleware, Replicas, Router
from modserve.server.routes import ROUTES
from modserve.server.state import ServerState


def build_app(engine: AsyncEngine | Sequence[AsyncEngine]) -> Starlette:
    """The app serving ``engine`` (or several data-parallel replicas of one pipeline, routed
    per prompt by :class:`~modserve.server.router.Router`). Metrics and tracing are the
    engines' observer plugins (the pipeline's ``observers``).

    The engine loops start with the app (ASGI lifespan) and stop with it."""
    engines = [engine] if isinstance(engine, AsyncEngine) else list(engine)
    replicated = len(engines) > 1
    first = engines[0]
    cfg = first.pipeline.server

    @asynccontextmanager
    async def lifespan(app: Starlette):
        for e in engines:
            e.start()
        try:
            yield
        finally:
            for e in engines:
                await e.stop()
                e.engine.shutdown()  # closes the observers (tracing flushes its spans)

    middleware = [Middleware(AccessLogMiddleware)] if cfg.log_requests else []
    if replicated:
        middleware.append(Middleware(ReplicaHeaderMiddleware))
    keys = api_keys(cfg)
    if keys:
        middleware.append(Middleware(AuthMiddleware, keys=keys, exempt_paths=cfg.auth_exempt_paths))
    app = Starlette(routes=ROUTES, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    router = Router(len(engines), first.engine.kv.block_size) if replicated else None
    app.state.server = ServerState(first, cfg, replicas=engines, router=router)
    return app


def build_replicas(pipeline: Any) -> list[AsyncEngine]:
    """``parallel.data_parallel_size`` engines built from ``pipeline``, each on its own loop
    thread, with their graphs captured."""
    n = pipeline.parallel.data_parallel_size
    if n > 1 and pipeline.parallel.tensor_parallel_size > 1:
        raise ConfigError(
            "parallel.data_parallel_size: replicas of a tensor-parallel engine are not supported; "
            "use data_parallel_size > 1 with tensor_parallel_size 1"
        )
    engines = [Engine.from_config(pipeline, replica=i if n > 1 else None) for i in range(n)]
    for engine in engines:
        engine.capture_graphs()
    return [AsyncEngine(engine) for engine in engines]


def serve(
    pipeline_source: Any = None, host: str | None = None, port: int | None = None, replicas: int | None = None,
    **overrides: Any,
) -> int:
    """Run the server until SIGTERM (drained: 0) or an engine failure (1).

    ``replicas`` overrides ``parallel.data_parallel_size``. A start-up failure (bad config: 2,
    anything else: 1) prints one line naming the reason."""
    _configure_logging()
    cli = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    if cli:  # validated with the pipeline, so a bad --port is a config error
        overrides["server"] = {**overrides.get("server", {}), **cli}
    if replicas is not None:
        overrides["parallel"] = {**overrides.get("parallel", {}), "data_parallel_size": replicas}
    sock = None
    try:
        pipeline = resolve(pipeline_source, **overrides).pipeline  # a bad pipeline fails before any port is bound
        cfg = pipeline.server
        sock = bind(cfg.host, cfg.port)
        engines = build_replicas(pipeline)
        app = build_app(engines)
        engine = engines[0] if len(engines) == 1 else Replicas(engines)
    except Exception as e:
        if sock is not None:
            sock.close()
        print(f"modserve serve: error: {_one_line(e)}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    if pipeline.ray is not None:
        print("modserve: note: the pipeline's ray: section applies to `modserve ray serve`; "
              "this server runs the pipeline on this machine", file=sys.stderr, flush=True)
    runner = Runner(app, engine, sock, cfg.shutdown_grace_s, main_loop=engines[0])
    keys = api_keys(cfg)
    auth = f"{len(keys)} API key(s) required" if keys else "no API key configured: authentication is disabled"
    url_host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    where = f" on {len(engines)} replicas" if len(engines) > 1 else ""
    print(f"modserve: serving {engines[0].model_name!r}{where} at http://{url_host}:{runner.port}/v1 ({auth})", flush=True)
    with startup_heap_frozen():
        return runner.run()


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Keep what start-up left alive (imports, model, tokenizer, plugins: ~320k objects) out
    of the cyclic collector's full passes while serving, as vLLM does: one pass over them
    took 135-160 ms, a stall that every stream in flight would see. What serving
    allocates stays collectable. Unfrozen at exit, where native bindings check for leaks."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn").setLevel(logging.WARNING)


def _one_line(e: Exception) -> str:
    message = " ".join(str(e).split()) or type(e).__name__
    return message if isinstance(e, (ConfigError, ValueError, OSError)) else f"{type(e).__name__}: {message}"
