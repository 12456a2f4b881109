"""Shared by the ``test_reliability_*`` files: live servers whose engine is built from a
given plugin registry (fault-injection and slow plugins), and waiting for an idle engine."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import httpx
from server_helpers import LiveServer, parse_metrics, pipeline, wait_ready

from modserve.core.async_engine import AsyncEngine
from modserve.core.config import ServerSection
from modserve.core.engine import Engine
from modserve.core.engine_factory import build_components
from modserve.core.contract import hookimpl
from modserve.core.plugin_manager import PluginRegistry
from modserve.server.app import build_app
from modserve.server.lifecycle import Runner, bind
from modserve.plugins.schedulers.fcfs import FCFSScheduler


def registry(**kinds: dict[str, type]) -> PluginRegistry:
    """A registry with the built-ins plus ``kinds``, e.g. ``samplers={"faulty": FaultySampler}``."""
    module = types.ModuleType("test_plugins")
    module.MODSERVE_CONTRACT = "2.0"
    for kind, impls in kinds.items():
        setattr(module, f"register_{kind}", hookimpl(_returning(impls)))
    reg = PluginRegistry()
    reg.register_module(module, source="tests")
    return reg


def _returning(value):
    return lambda: value


class RegistryServer(LiveServer):
    """``LiveServer`` whose engine uses ``reg`` (so a pipeline may name test plugins).

    ``server`` keys the pipeline schema does not know yet (``max_prompt_tokens``,
    ``max_output_tokens``) are applied to the server's limits directly."""

    def __init__(self, reg: PluginRegistry | None = None, **sections: dict[str, Any]) -> None:
        server = dict(sections.pop("server", {}))
        later = {k: server.pop(k) for k in list(server) if k not in ServerSection.__struct_fields__}
        config = pipeline(**sections, server=server)
        self.engine = AsyncEngine(Engine(build_components(config, registry=reg or PluginRegistry())))
        self.app = build_app(self.engine)
        for key, value in later.items():
            setattr(self.app.state.server.limits, key, value)
        self.runner = Runner(self.app, self.engine, bind("127.0.0.1", 0), self.engine.pipeline.server.shutdown_grace_s)
        self.url = f"http://127.0.0.1:{self.runner.port}"
        self.exit_code = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RegistryServer:
        self._thread.start()
        wait_ready(self.url)
        return self


class SlowScheduler(FCFSScheduler):
    """FCFS with a pause before each step, so load tests do not depend on the machine's speed."""

    delay_s = 0.01

    def schedule(self):
        time.sleep(self.delay_s)
        return super().schedule()


def wait_idle(url: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Poll ``/metrics`` until nothing runs or waits and the KV cache is empty; returns the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(httpx.get(f"{url}/metrics", headers=headers).text)
        idle = (m["modserve:num_requests_running"], m["modserve:num_requests_waiting"], m["modserve:kv_cache_usage_perc"])
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            assert idle == (0, 0, 0), f"not idle after {timeout}s: running, waiting, kv usage = {idle}"
            return m
        time.sleep(0.05)


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a response, checking its shape."""
    assert r.headers["content-type"] == "application/json", r.text[:300]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name{labels}`` in parsed metrics (0 if the series does not exist yet)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for key, value in m.items():
        base, _, rest = key.partition("{")
        if base == name and sorted(filter(None, rest.rstrip("}").split(","))) == sorted(want):
            return value
    return 0.0
