"""Rank 0 of a tensor-parallel engine: starts the workers, then drives them every step.

The engine process is rank 0: it keeps the scheduler, the block pool, the sampler and
its own shard of the model. :class:`WorkerGroup` spawns ranks 1..N-1 (``spawn``
processes, rendezvous over a ``TCPStore`` on a free port of 127.0.0.1) and watches them;
:class:`TPModelRunner` is the engine's runner: for each step it sends the step header
and recorded KV block copies down each worker's pipe, broadcasts the flat batch, runs its
own forward (whose all-reduces pair with the workers') and receives the gathered logits.

Failure model: a worker that dies, a collective that times out (``parallel.timeout_s``)
or any error inside a tensor-parallel step leaves the group out of step, so the runner
declares the engine dead (:attr:`TPModelRunner.dead` names the rank), stops the other
workers and raises :class:`WorkerDiedError`; the engine then fails its requests.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import signal
import time
import weakref
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modserve.core.distributed import worker
from modserve.core.distributed.errors import WorkerDiedError
from modserve.core.distributed.kv_sync import KVCopyRecorder
from modserve.core.distributed.tp import TPGroup, parameter_bytes, pick_backend, resident_bytes
from modserve.core.models.loader import read_spec
from modserve.core.runner import ModelRunner, StepBatch

STARTUP_TIMEOUT_S = 900.0  # loading a shard may take long; a worker that dies is noticed at once


def check_pipeline(r, spec=None) -> None:
    """Refuse, before any process starts, what tensor parallelism cannot run (errors name the key)."""
    from modserve.core.config import ConfigError
    from modserve.core.distributed.sharding import check_divisible

    p = r.pipeline
    n = p.parallel.tensor_parallel_size
    if spec is not None:
        check_divisible(spec, n)
    if p.speculative and p.speculative.get("draft") is not None:
        raise ConfigError(
            "speculative.draft: a draft made of the target's own layers is not supported with "
            f"parallel.tensor_parallel_size {n} (those layers are sharded); use a draft `path` or `ngram`"
        )
    on_cuda = r.platform.device().type == "cuda"
    if pick_backend(p.parallel.backend, r.platform) == "nccl" and (not on_cuda or torch.cuda.device_count() < n):
        raise ConfigError(
            f"parallel.backend: nccl needs {n} CUDA devices, found "
            f"{torch.cuda.device_count() if on_cuda else 0} (device {p.device!r}); use gloo on the CPU"
        )


def start_workers(r) -> WorkerGroup:
    """Check the pipeline, then spawn ranks 1..N-1 (they begin loading their shards at once)."""
    from modserve.core.contract import BuildContext

    ctx = BuildContext(r.registry, r.pipeline.model.max_model_len)
    check_pipeline(r, read_spec(r.source, ctx) if r.source.kind == "hf" else None)
    return WorkerGroup(r.pipeline, r.platform)


class WorkerGroup:
    """Worker processes for ranks 1..N-1 plus rank 0's own :class:`TPGroup`."""

    def __init__(self, pipeline, platform) -> None:
        par = pipeline.parallel
        self.world_size = par.tensor_parallel_size
        self.backend = pick_backend(par.backend, platform)
        self.timeout_s = par.timeout_s
        self.tp = TPGroup(0, self.world_size)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=par.timeout_s),
        )
        ctx = mp.get_context("spawn")
        self.threads = threads = max(1, (os.cpu_count() or 1) // self.world_size)  # torch threads per rank
        raw = msgspec.to_builtins(pipeline)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.info: list[dict[str, Any]] = []
        self.errors: dict[int, str] = {}
        try:
            for rank in range(1, self.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=worker.main,
                    args=(rank, self.world_size, raw, self.store.port, self.backend, self.timeout_s, child, threads),
                    name=f"modserve-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        except BaseException:
            self.stop()
            raise

    # ----------------------------------------------------------------- start-up

    def wait_ready(self, num_blocks: int) -> None:
        """Wait for every worker to load its shard (failing fast if one dies), then join the group."""
        pending = dict(enumerate(self.conns, start=1))
        info: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers {sorted(pending)} did not load within {STARTUP_TIMEOUT_S:.0f} s")
            multiprocessing.connection.wait([*pending.values(), *(self.procs[r - 1].sentinel for r in pending)], timeout=1.0)
            for rank, conn in list(pending.items()):
                if conn.poll():
                    try:
                        kind, payload = conn.recv()
                    except (EOFError, OSError):
                        kind, payload = "error", None
                    if kind == "ready":
                        info[rank] = payload
                        del pending[rank]
                        continue
                    if payload:
                        self.errors[rank] = payload
                if not self.procs[rank - 1].is_alive():
                    self.procs[rank - 1].join(1)
                    hint = "" if rank in self.errors else (
                        " before reporting (see its stderr); a script that builds a tensor-parallel engine must do "
                        "so under `if __name__ == \"__main__\":`, because workers are spawned and re-import the main module"
                    )
                    raise RuntimeError(f"tensor-parallel start-up failed: {self.describe_dead()}{hint}")
        for rank, i in info.items():
            if i["num_blocks"] != num_blocks:
                raise RuntimeError(f"tensor-parallel rank {rank} built {i['num_blocks']} KV blocks, rank 0 built {num_blocks}")
        self.info = [info[r] for r in sorted(info)]
        self.tp.connect("127.0.0.1", self.store.port, self.backend, self.timeout_s, store=self.store)

    # ----------------------------------------------------------------- health

    def dead_ranks(self) -> list[int]:
        return [rank for rank, p in enumerate(self.procs, start=1) if p.exitcode is not None]

    def collect_errors(self) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll():
                    kind, payload = conn.recv()
                    if kind == "error":
                        self.errors[rank] = payload
            except (EOFError, OSError):
                pass

    def describe_dead(self, read_errors: bool = True) -> str:
        """One line per dead worker: rank, pid, signal or exit code, and its last error line if
        it sent one (``read_errors=False``: do not touch the pipes, for other threads)."""
        if read_errors:
            self.collect_errors()
        parts = []
        for rank in self.dead_ranks():
            p = self.procs[rank - 1]
            how = f"killed by signal {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
            err = self.errors.get(rank)
            last = f": {err.strip().splitlines()[-1]}" if err else ""
            parts.append(f"tensor-parallel worker rank {rank} (pid {p.pid}) died ({how}){last}")
        return "; ".join(parts)

    def wait_for_death(self, timeout: float) -> None:
        """After a failed collective: give a worker that is going down time to be reaped."""
        live = [p.sentinel for p in self.procs if p.exitcode is None]
        if live and len(live) == len(self.procs):
            multiprocessing.connection.wait(live, timeout=timeout)
        time.sleep(0.1)  # a peer that saw the first death exits right after

    # ----------------------------------------------------------------- control

    def send(self, msg) -> None:
        for conn in self.conns:
            conn.send(msg)

    def stats(self) -> list[dict[str, Any]]:
        self.send(("stats",))
        out = []
        for conn in self.conns:
            if not conn.poll(self.timeout_s):
                raise TimeoutError("a tensor-parallel worker did not answer a stats request")
            out.append(conn.recv()[1])
        return out

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask every worker to exit, then terminate (and kill) the ones that do not. Idempotent."""
        _stop(self.procs, self.conns, grace_s)
        self.tp.pg = None
        self.tp.store = None


def _stop(procs, conns, grace_s: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
            p.join(1.0)
        if p.exitcode is None:
            p.kill()
            p.join(1.0)
    for conn in conns:
        conn.close()


def _timed_out(e: Exception) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


class TPModelRunner(ModelRunner):
    """Rank 0's runner: the base runner's batch, broadcast to the workers before each forward."""

    def __init__(self, model, kv, attention, device: torch.device, workers: WorkerGroup) -> None:
        super().__init__(model, kv, attention, device)
        self.workers = workers
        self.tp: TPGroup = workers.tp
        self.world_size = workers.world_size
        self.comm_device = device if workers.backend == "nccl" else torch.device("cpu")
        self.copies = KVCopyRecorder(kv)
        self._dead: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, workers.procs, workers.conns)
        self._threads_before = torch.get_num_threads()
        if device.type == "cpu":  # N ranks share the cores: oversubscribed OpenMP pools crawl
            torch.set_num_threads(workers.threads)

    @property
    def dead(self) -> str | None:
        """Why this engine can no longer run (names the dead rank), or None while it is healthy.

        Only polls the worker processes, so any thread may read it (a health check); the
        engine's thread stops what is left of the group (``execute`` / ``shutdown``)."""
        if self._dead is None and not self._closed and self.workers.dead_ranks():
            self._dead = self.workers.describe_dead(read_errors=False)
        return self._dead

    def execute(self, batch: StepBatch, logits_rows: list[int]) -> torch.Tensor:
        if self.dead is not None:
            self._declare_dead(self._dead)
            raise WorkerDiedError(self._dead)
        if self._closed:
            raise RuntimeError("the engine was shut down")
        meta = batch.meta
        b, w = meta.block_tables.shape
        try:
            self.workers.send(("step", meta.num_tokens, b, w, len(logits_rows), self.copies.take()))
            rows = torch.tensor(logits_rows, dtype=torch.int64, device=batch.input_ids.device)
            payload = torch.cat([
                batch.input_ids, batch.positions, meta.slot_mapping, meta.query_start_loc.long(),
                meta.seq_lens.long(), meta.context_lens.long(), meta.request_lens.long(), meta.block_tables.long().flatten(), rows,
            ]).to(self.comm_device)
            self.tp.broadcast(payload)
            logits = super().execute(batch, logits_rows)
        except Exception as e:  # the group is out of step whatever failed: no way back
            if not _timed_out(e):
                self.workers.wait_for_death(timeout=2.0)
            message = self.workers.describe_dead() or self._describe_failure(e)
            self._declare_dead(message)
            raise WorkerDiedError(message) from e
        return logits

    def _describe_failure(self, e: Exception) -> str:
        """No worker died: a collective timed out (a worker hung) or rank 0 itself failed mid-step."""
        if _timed_out(e):
            return (
                f"tensor-parallel collective timed out after parallel.timeout_s={self.workers.timeout_s:g} s: "
                f"a worker stopped answering (hung?); the worker group was stopped ({type(e).__name__}: {str(e)[:300]})"
            )
        return f"tensor-parallel step failed on rank 0 ({type(e).__name__}: {str(e)[:300]}); the worker group is out of step and was stopped"

    def _declare_dead(self, message: str) -> None:
        self._dead = message
        self._release()
        self.workers.stop(grace_s=1.0)

    def shutdown(self) -> None:
        """Stop the workers (idempotent); the engine cannot step afterwards."""
        if not self._closed:
            self._closed = True
            self._release()
            self._finalizer()
            self.workers.stop(grace_s=0)

    def _release(self) -> None:
        self.copies.close()
        if self.device.type == "cpu" and torch.get_num_threads() == self.workers.threads:
            torch.set_num_threads(self._threads_before)

    def rank_stats(self) -> list[dict[str, Any]]:
        """Per rank (0 first): parameter bytes, KV bytes, resident memory; workers answer over their pipe."""
        kv_bytes = sum(
            t.numel() * t.element_size() for c in self.kv.layer_caches() for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None
        )
        own = {"pid": os.getpid(), "num_blocks": self.kv.num_blocks, "param_bytes": parameter_bytes(self.model),
               "kv_bytes": kv_bytes, "rss": resident_bytes()}
        return [own, *self.workers.stats()]
