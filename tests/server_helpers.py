"""Live servers for the server tests: a tiny random model behind uvicorn on 127.0.0.1.

``LiveServer`` runs the real app and lifecycle (``Runner``) in a background thread on a
free port; ``server_process`` runs ``python -m modserve.server`` as a subprocess for
what needs signals. The tiny model is built once per test process.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
import threading
from typing import Any

import httpx
import openai
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import build_model  # noqa: E402

from modserve.core.async_engine import AsyncEngine  # noqa: E402
from modserve.bench.launch import launch_server, wait_ready  # noqa: E402,F401  (wait_ready: re-exported to the tests)
from modserve.core.engine import Engine  # noqa: E402
from modserve.server.app import build_app  # noqa: E402
from modserve.server.lifecycle import Runner, bind  # noqa: E402

MODEL_NAME = "tiny-llama"


@functools.lru_cache(maxsize=None)
def tiny_model_dir(max_position_embeddings: int = 512) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="modserve-server-test-"), MODEL_NAME)
    build_model(path, "llama", max_position_embeddings=max_position_embeddings)
    return path


def pipeline(max_position_embeddings: int = 512, **sections: dict[str, Any]) -> dict[str, Any]:
    """The test pipeline; each keyword replaces keys inside that section."""
    base: dict[str, Any] = {
        "model": {"path": tiny_model_dir(max_position_embeddings), "name": MODEL_NAME},
        "scheduler": {"plugin": "fcfs", "max_num_seqs": 32, "max_num_batched_tokens": 512},
        "kv_cache": {"plugin": "paged", "block_size": 16, "num_blocks": 256},
        "server": {"host": "127.0.0.1", "port": 0},
    }
    for key, value in sections.items():
        base[key] = value if isinstance(value, list) else {**base.get(key, {}), **value}
    return base


class ThreadedServer:
    """Serves ``app`` on a free 127.0.0.1 port in a thread while the ``with`` block runs."""

    def __init__(self, app, engine, grace_s: float) -> None:
        self.app = app
        self.runner = Runner(app, engine, bind("127.0.0.1", 0), grace_s)
        self.url = f"http://127.0.0.1:{self.runner.port}"
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.exit_code = self.runner.run()

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self.runner.shutdown()
            self._thread.join(30)


class LiveServer(ThreadedServer):
    """``with LiveServer(server={...}) as s:`` serves on ``s.url`` until the block ends."""

    def __init__(self, **sections: dict[str, Any]) -> None:
        self.engine = AsyncEngine(Engine.from_config(pipeline(**sections)))
        super().__init__(build_app(self.engine), self.engine, self.engine.pipeline.server.shutdown_grace_s)

    def wait_exit(self, timeout: float) -> int | None:
        self._thread.join(timeout)
        return self.exit_code

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", headers=headers).text)


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, with the labels kept in the key (model_name dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")] = float(value)
    return out


def server_process(tmp_path, **sections: dict[str, Any]) -> tuple[subprocess.Popen, str]:
    """Start ``python -m modserve.server`` on a free port; returns it and its base URL."""
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump(pipeline(**sections)))
    proc, url, _ = launch_server(["modserve.server", "-c", str(config)], tmp_path / "server.log", timeout=60)
    return proc, url
