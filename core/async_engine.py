"""AsyncEngine: the engine loop on its own thread, one async output stream per request.

The :class:`~modserve.core.engine.Engine` is not thread-safe, so only the loop thread
touches it. The loop thread is either one this class starts or, with
:meth:`AsyncEngine.run_loop`, the caller's: the server runs it on the process's main
thread, where the model was loaded (see ``run_loop`` for why that is faster). The event loop submits and aborts through a thread-safe inbox and gets each
step's outputs back through ``call_soon_threadsafe``: it never waits on model work.
The engine emits one output per request and step (its ``n`` choices merged there), and
each stream yields those outputs as they come.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from modserve.core.engine import Engine
from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams

log = logging.getLogger("modserve.engine")


class EngineDeadError(RuntimeError):
    """The engine loop thread died; nothing can be served any more."""


class ServerBusyError(RuntimeError):
    """Not admitted: the waiting queue is full or the server is draining (HTTP 503)."""

    def __init__(self, message: str, code: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutdown grace period over)."""


class RequestFailedError(RuntimeError):
    """The engine finished the request with ``finish_reason == "error"``."""


@dataclass
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams  # with n: the engine forks the n sequences from one prompt
    priority: int
    cache_salt: str | None
    user: str | None


@dataclass
class _Abort:
    request_ids: list[str] | None  # None: every request in the engine


_STOP = object()


class AsyncEngine:
    """Owns the loop thread; ``generate`` admits a request and returns its stream."""

    def __init__(self, engine: Engine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.pipeline = engine.c.pipeline
        self.model_name = engine.c.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.c.spec.vocab_size
        self.tokenizer = engine.tokenizer
        self.tool_parser = engine.c.tool_parser  # output parsers the server applies (None: not configured)
        self.reasoning_parser = engine.c.reasoning_parser
        self.max_waiting_requests = max_waiting_requests or self.pipeline.server.max_waiting_requests
        self._burst_gap_s = self.pipeline.server.burst_window_ms / 1000
        self.draining = False
        self.dead_reason: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._submitted = 0  # sequences put in the inbox (event loop thread only)
        self._consumed = 0  # sequences taken out of it (loop thread only)
        self._num_waiting = 0  # the engine's waiting queue after the last step (loop thread only)
        self._streams: set[RequestStream] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._dead = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._caller_runs_loop = False
        self._loop_exited = threading.Event()

    # ----------------------------------------------------------------- event loop side

    def start(self) -> None:
        """Start the loop thread (unless ``run_loop`` runs it); call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        if self.dead_reason is not None:  # the loop died before anyone listened
            self._on_death()
        if self._caller_runs_loop:
            return
        self._thread = threading.Thread(
            target=self._run, args=(torch.get_num_threads(),), name="modserve-engine", daemon=True
        )
        self._thread.start()

    def claim_loop(self) -> None:
        """Promise to call ``run_loop``: from now on ``start`` spawns no loop thread."""
        self._caller_runs_loop = True

    def run_loop(self) -> None:
        """Run the engine loop on the calling thread until ``stop`` (or the engine dies).

        Call ``claim_loop`` before anything may call ``start``, then this instead of letting
        ``start`` spawn a thread, ideally from the thread that loaded the model. Each thread that runs torch ops gets its own OpenMP worker pool;
        once more pool threads exist than cores, libgomp stops spinning between parallel
        regions, and every op pays a futex wake-up. Measured with 2 cores: a 16-row linear
        took 0.37 ms on the loading thread, 0.55 ms on a new one; a decode step at 16
        requests 105 vs 145 ms.
        """
        self.claim_loop()
        self._run(torch.get_num_threads())

    def stop_loop(self) -> None:
        """Thread-safe: make the loop return after its current step, aborting what is left."""
        self._inbox.put(_STOP)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the field, for a request the engine would refuse (reads only
        what is fixed at start-up: safe from the event loop). ``generate`` does it unless told
        the caller already has."""
        self.engine.validate(prompt_token_ids, params)

    def check_capacity(self, num_seqs: int) -> None:
        """Raise unless ``num_seqs`` more sequences may wait (call before a batch of ``generate``)."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine loop died: {self.dead_reason}")
        if self.draining:
            raise ServerBusyError("the server is shutting down", "shutting_down", retry_after_s=5)
        waiting = self.num_waiting
        if waiting + num_seqs > self.max_waiting_requests:
            raise ServerBusyError(
                f"the server is overloaded: {waiting} sequences are waiting "
                f"(server.max_waiting_requests is {self.max_waiting_requests})",
                "overloaded",
                retry_after_s=1,
            )

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        user: str | None = None,
        prompt: str | None = None,
        validated: bool = False,
    ) -> RequestStream:
        """Admit one request (raises ``ValueError`` for a bad one, :class:`ServerBusyError` /
        :class:`EngineDeadError` at once). ``validated``: the caller ran :meth:`validate`.

        The caller must ``abort()`` the stream when it stops reading early, e.g. in a
        ``finally``; aborting a finished stream does nothing.
        """
        if not validated:
            self.validate(prompt_token_ids, params)
        self.check_capacity(params.n)
        stream = RequestStream(self, request_id, prompt, params.n)
        self._streams.add(stream)
        self._idle.clear()
        self._submitted += params.n
        self._inbox.put(_Add(stream, list(prompt_token_ids), params, priority, cache_salt, user))
        return stream

    @property
    def num_active(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Sequences not yet running: the engine's queue after its last step plus those still in the inbox."""
        return self._num_waiting + self._submitted - self._consumed

    @property
    def kv_usage(self) -> float:
        """The KV cache's used fraction (0..1), as the loop thread last left it."""
        return self.engine.kv.stats().usage

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, give in-flight ones ``grace_s`` to finish, then abort the rest."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("shutdown grace period over: aborting %d in-flight requests", self.num_active)
            self.abort_all()
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                pass

    def abort_all(self) -> None:
        """Abort every request in the engine (their streams raise :class:`RequestAbortedError`)."""
        self._inbox.put(_Abort(None))

    async def wait_dead(self) -> str:
        await self._dead.wait()
        return self.dead_reason or "unknown"

    async def stop(self) -> None:
        """Abort whatever is left and wait for the loop to return."""
        self.draining = True
        if (self._thread is not None or self._caller_runs_loop) and not self._loop_exited.is_set():
            self.stop_loop()
            await asyncio.to_thread(self._loop_exited.wait, 10.0)

    def _abort(self, request_ids: list[str]) -> None:
        self._inbox.put(_Abort(request_ids))

    def _stream_done(self, stream: RequestStream) -> None:
        self._streams.discard(stream)
        if not self._streams:
            self._idle.set()

    def _dispatch(self, batches: list[tuple[RequestStream, list[RequestOutput] | BaseException]]) -> None:
        for stream, item in batches:
            stream._push(item)

    def _on_death(self) -> None:
        for stream in list(self._streams):
            stream._push(EngineDeadError(f"engine loop died: {self.dead_reason}"))
        self._dead.set()

    # ----------------------------------------------------------------- loop thread side

    def _run(self, num_threads: int) -> None:
        # A new thread's OpenMP team is not sized by the main thread's setting: without this,
        # every torch op in the engine ran on one core (measured: 260 vs 123 ms a decode step).
        torch.set_num_threads(num_threads)
        routes: dict[str, RequestStream] = {}
        try:
            while True:
                idle = not self.engine.has_unfinished()
                cmds = self._take(block=idle)
                if idle:
                    cmds += self._rest_of_burst()
                outputs: list[RequestOutput] = []
                for cmd in cmds:
                    if cmd is _STOP:
                        self._send(self.engine.abort_request(list(self.engine.requests)), routes)
                        return
                    outputs += self._apply(cmd, routes)
                if cmds or self.engine.has_unfinished():
                    outputs += self.engine.step()  # also refreshes step stats after aborts
                self._num_waiting = self.engine.scheduler.stats().num_waiting
                self._send(outputs, routes)
        except BaseException as e:  # the engine's state is unknown now: fail everything
            try:
                self.dead_reason = self._death_reason(e)
            except Exception:
                self.dead_reason = f"{type(e).__name__}: {e}"
            self._call(self._on_death)
        finally:
            self._loop_exited.set()

    def _death_reason(self, e: BaseException) -> str:
        """``"<section> plugin '<name>' failed: <Type>: <message>"`` when a plugin raised it, else ``"<Type>: <message>"``."""
        plain = f"{type(e).__name__}: {e}"
        described = self.engine.faults.describe(e, "engine loop")  # logs it with the traceback
        return plain if described.startswith("engine loop failed:") else described

    def _take(self, block: bool) -> list:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _rest_of_burst(self) -> list:
        """Commands still arriving at most ``server.burst_window_ms`` apart (for at most 10x
        that). A burst of requests reaches an idle engine over a few ms (64 took 15 ms over
        HTTP here): stepping on the first one made the first step a small prefill, and the
        rest waited for a whole step behind it (+115-266 ms on every TTFT of the burst)."""
        more: list = []
        if self._burst_gap_s <= 0:
            return more
        deadline = time.monotonic() + 10 * self._burst_gap_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                more.append(self._inbox.get(timeout=min(self._burst_gap_s, left)))
            except queue.Empty:
                break
        return more + self._take(block=False)

    def _apply(self, cmd, routes: dict[str, RequestStream]) -> list[RequestOutput]:
        if isinstance(cmd, _Abort):
            ids = list(self.engine.requests) if cmd.request_ids is None else cmd.request_ids
            return self.engine.abort_request(ids)
        stream = cmd.stream
        try:
            self.engine.enqueue(  # validated in ``generate``
                cmd.prompt_token_ids, cmd.params, request_id=stream.request_id, priority=cmd.priority,
                cache_salt=cmd.cache_salt, user=cmd.user,
            )
            routes[stream.request_id] = stream
        except ValueError as e:
            self._call(self._dispatch, [(stream, e)])
        except Exception as e:  # a plugin raised while enqueueing (the scheduler's add_request)
            if self.engine.dead is not None:
                raise  # the engine cannot run at all any more
            self._call(self._dispatch, [(stream, RequestFailedError(self._fail_admission(e, stream)))])
        finally:
            self._num_waiting = self.engine.scheduler.stats().num_waiting
            self._consumed += stream.n
        return []

    def _fail_admission(self, e: Exception, stream: RequestStream) -> str:
        """Fail only this request (500 naming the plugin) and drop what the engine kept of it."""
        message = self.engine.faults.describe(e, "scheduler")
        self.engine.abort_request([stream.request_id], reason="error", error=message)
        return message

    def _send(self, outputs: list[RequestOutput], routes: dict[str, RequestStream]) -> None:
        grouped: dict[RequestStream, list[RequestOutput]] = {}
        for out in outputs:
            stream = routes.pop(out.request_id) if out.finished else routes.get(out.request_id)
            if stream is not None:
                grouped.setdefault(stream, []).append(out)
        if grouped:
            self._call(self._dispatch, list(grouped.items()))

    def _call(self, fn, *args) -> None:
        if self._loop is None:  # not started yet: ``start`` reports a death itself
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class RequestStream:
    """Async iterator over one request's outputs: each holds the choices that advanced in
    one engine step (``n > 1`` merged by the engine); the last has ``finished=True``."""

    def __init__(self, owner: AsyncEngine, request_id: str, prompt: str | None, n: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.n = n
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pushed_final = False  # the engine sent its last output
        self._read_final = False  # the reader got it (or an error)
        self._ready: list[RequestOutput] = []  # outputs of one pushed step not read yet
        self.closed = False

    def abort(self) -> None:
        """Stop the request in the engine (its KV blocks return within a step)."""
        if not self.closed:
            self._close()
            if not self._pushed_final:
                self._owner._abort([self.request_id])

    def _close(self) -> None:
        self.closed = True
        self._owner._stream_done(self)

    def _push(self, item: list[RequestOutput] | BaseException) -> None:
        if self.closed:
            return
        self._queue.put_nowait(item)
        if isinstance(item, BaseException) or any(o.finished for o in item):
            self._pushed_final = True
            self._close()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._read_final:
            raise StopAsyncIteration
        if not self._ready:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._read_final = True
                raise item
            self._ready = list(item)
        out = self._ready.pop(0)
        out.prompt = self.prompt
        self._check(out)
        if out.finished:
            self._read_final = True
        return out

    def _check(self, out: RequestOutput) -> None:
        for c in out.outputs:
            if c.finish_reason == "abort":
                self._read_final = True
                raise RequestAbortedError("the request was aborted: the server is shutting down")
            if c.finish_reason == "error":
                self._read_final = True
                raise RequestFailedError(out.error or "the engine failed this request")
