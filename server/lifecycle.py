"""Runs the app on uvicorn with modserve's rules for stopping.

uvicorn alone closes its listener at the first SIGTERM (new clients get connection
refused, not a 503) and re-raises the signal once done (exit status -15). Here SIGTERM
starts a drain instead: new requests get 503, in-flight ones have
``server.shutdown_grace_s`` to finish, the rest are aborted, and the process exits 0.
A second signal aborts the in-flight requests at once. If the engine loop thread dies, the server stops and
``run`` returns 1 within seconds.

``serve`` hands the Runner the engine whose loop should run on the main thread (where the
model was loaded, see ``AsyncEngine.run_loop``); uvicorn then runs on a second thread and
the main thread takes SIGTERM/SIGINT itself.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from contextlib import contextmanager

import uvicorn

from modserve.core.async_engine import AsyncEngine

log = logging.getLogger("modserve.server")


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails fast (the socket listens later)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class Runner:
    def __init__(
        self, app, engine: AsyncEngine, sock: socket.socket, grace_s: float, *, main_loop: AsyncEngine | None = None
    ) -> None:
        config = uvicorn.Config(app, lifespan="on", log_config=None, access_log=False, timeout_graceful_shutdown=5)
        self.server = _Server(config, self)
        self.engine = engine
        self.sock = sock
        self.grace_s = grace_s
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self.main_loop = main_loop  # its engine loop runs on the thread calling ``run``

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def run(self) -> int:
        """Serve until drained or the engine dies; returns the process exit code."""
        if self.main_loop is None:
            return self._serve()
        self.main_loop.claim_loop()  # before uvicorn's lifespan calls start()
        codes: list[int] = []
        http = threading.Thread(target=self._serve_beside_engine, args=(codes,), name="modserve-http")
        with self._signals_start_drain():
            http.start()
            self.main_loop.run_loop()  # returns once the app has stopped it, or the engine died
            http.join()
        return codes[0]

    def _serve(self) -> int:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except SystemExit as e:  # uvicorn exits this way when the app's startup fails
            return e.code if isinstance(e.code, int) and e.code else 1
        return self.exit_code

    def _serve_beside_engine(self, codes: list[int]) -> None:
        try:
            codes.append(self._serve())
        except BaseException:
            codes.append(1)
            raise
        finally:
            self.main_loop.stop_loop()  # the app never started (or crashed): free the main thread

    @contextmanager
    def _signals_start_drain(self):
        """SIGTERM/SIGINT start the drain (a second one aborts), as uvicorn's handler does on its own main thread."""
        handlers = {sig: signal.signal(sig, lambda *_: self.shutdown()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def shutdown(self) -> None:
        """Thread-safe: begin the drain, as SIGTERM does."""
        if self.loop is None:  # still starting: stop as soon as uvicorn looks
            self.server.should_exit = True
            return
        try:
            self.loop.call_soon_threadsafe(self._on_signal)
        except RuntimeError:  # the event loop has closed: the server is already stopping
            pass

    def _on_signal(self) -> None:
        if self._drain is None:
            log.info("shutdown requested: refusing new requests, %d in flight", self.engine.num_active)
            self._drain = asyncio.ensure_future(self._drain_then_exit())
        else:
            log.warning("second shutdown signal: aborting %d in-flight requests now", self.engine.num_active)
            self.engine.abort_all()
            self.server.should_exit = True

    async def _drain_then_exit(self) -> None:
        await self.engine.drain(self.grace_s)
        self.server.should_exit = True

    async def _watchdog(self) -> None:
        reason = await self.engine.wait_dead()
        log.error("engine loop died (%s): stopping the server", reason)
        self.exit_code = 1
        self.server.should_exit = True


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runner: Runner) -> None:
        super().__init__(config)
        self.runner = runner

    async def serve(self, sockets=None) -> None:
        self.runner.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.runner._watch = asyncio.ensure_future(self.runner._watchdog())

    def handle_exit(self, sig, frame) -> None:
        self.runner.loop.call_soon_threadsafe(self.runner._on_signal)
