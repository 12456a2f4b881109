"""The OpenAI-compatible server: ``build_app`` (the ASGI app, for tests) and ``serve`` (the CLI's)."""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware

from modserve.core.async_engine import AsyncEngine
from modserve.core.config import ConfigError, api_keys, load_pipeline
from modserve.core.engine import Engine
from modserve.core.server.access_log import AccessLogMiddleware
from modserve.core.server.auth import AuthMiddleware
from modserve.core.server.errors import EXCEPTION_HANDLERS
from modserve.core.server.lifecycle import Runner, bind
from modserve.core.server.routes import ROUTES
from modserve.core.server.state import ServerState
from modserve.plugins.observers.metrics import MetricsObserver
from modserve.plugins.observers.tracing import TracingObserver, make_exporter


def build_app(engine: AsyncEngine) -> Starlette:
    """The app serving ``engine``; registers the metrics and tracing observers on its engine.

    The engine loop starts with the app (ASGI lifespan) and stops with it."""
    pipeline, pm = engine.pipeline, engine.engine.c.registry.pm
    obs, cfg = pipeline.observability, pipeline.server
    metrics = tracing = None
    if obs.metrics:
        metrics = MetricsObserver(engine.model_name, engine.max_model_len)
        pm.register(metrics)
    exporter = make_exporter(obs.tracing)
    if exporter is not None:
        tracing = TracingObserver(engine.model_name, exporter, batch=obs.tracing.exporter != "console")
        pm.register(tracing)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        engine.start()
        try:
            yield
        finally:
            await engine.stop()
            if tracing is not None:
                tracing.shutdown()

    middleware = [Middleware(AccessLogMiddleware)] if cfg.log_requests else []
    keys = api_keys(cfg)
    if keys:
        middleware.append(Middleware(AuthMiddleware, keys=keys, exempt_paths=cfg.auth_exempt_paths))
    app = Starlette(routes=ROUTES, middleware=middleware, exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.server = ServerState(engine, cfg, metrics, tracing)
    return app


def serve(pipeline_source: Any = None, host: str | None = None, port: int | None = None, **overrides: Any) -> int:
    """Run the server until SIGTERM (drained: 0) or an engine failure (1).

    A start-up failure (bad config: 2, anything else: 1) prints one line naming the reason."""
    _configure_logging()
    cli = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    if cli:  # validated with the pipeline, so a bad --port is a config error
        overrides["server"] = {**overrides.get("server", {}), **cli}
    sock = None
    try:
        pipeline = load_pipeline(pipeline_source, **overrides)
        cfg = pipeline.server
        sock = bind(cfg.host, cfg.port)
        engine = AsyncEngine(Engine.from_config(pipeline))
        app = build_app(engine)
    except Exception as e:
        if sock is not None:
            sock.close()
        print(f"modserve serve: error: {_one_line(e)}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    runner = Runner(app, engine, sock, cfg.shutdown_grace_s)
    keys = api_keys(cfg)
    auth = f"{len(keys)} API key(s) required" if keys else "no API key configured: authentication is disabled"
    url_host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"modserve: serving {engine.model_name!r} at http://{url_host}:{runner.port}/v1 ({auth})", flush=True)
    return runner.run()


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn").setLevel(logging.WARNING)


def _one_line(e: Exception) -> str:
    message = " ".join(str(e).split()) or type(e).__name__
    return message if isinstance(e, (ConfigError, ValueError, OSError)) else f"{type(e).__name__}: {message}"
