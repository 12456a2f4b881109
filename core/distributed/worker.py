"""A tensor-parallel worker (ranks 1..N-1): load this rank's shard, then run every step rank 0 sends.

Started by rank 0 (:mod:`modserve.core.distributed.tp_runner`) in a fresh ``spawn``
process. Control messages come over a ``multiprocessing`` pipe, so an idle worker waits
there with no collective timeout running; the step's batch itself comes by broadcast.

Protocol (rank 0 -> worker over the pipe):

- ``("step", T, B, W, R, copies)``: then a broadcast of one int64 tensor holding
  ``input_ids[T] positions[T] slot_mapping[T] query_start_loc[B+1] seq_lens[B]
  context_lens[B] block_tables[B*W] logits_rows[R]``; the worker replays ``copies``
  (see :mod:`modserve.core.distributed.kv_sync`) and runs the same forward pass, whose
  all-reduces and final logits gather pair with rank 0's.
- ``("stats",)``: reply ``("stats", {...})`` with parameter and resident bytes.
- ``("stop",)``: exit 0.

Worker -> rank 0: ``("ready", info)`` once loaded, or ``("error", traceback)`` before it
exits 1. A closed pipe (rank 0 gone) makes the worker exit.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from modserve.core.distributed.kv_sync import KVReplica
from modserve.core.distributed.tp import TPGroup, parameter_bytes, release_free_memory, resident_bytes
from modserve.core.contract import AttentionMetadata
from modserve.core.runner import ModelRunner, StepBatch


def build_shard(pipeline: dict[str, Any], tp: TPGroup) -> tuple[ModelRunner, dict[str, int]]:
    """This rank's model shard, attention backend and KV shard, built as rank 0 builds its own;
    also the resident memory just before the weights were read (plugins already imported)."""
    from modserve.core.engine_factory import build_shard as build, resolve

    r = resolve(pipeline)
    before: dict[str, Any] = {}
    shard = build(r, tp.rank, tp, on_read=lambda: before.setdefault("rss", resident_bytes()))
    return ModelRunner(shard.model, shard.kv, shard.attention, shard.ctx.device), before["rss"]


def shard_stats(runner: ModelRunner, rss_before_load: dict[str, int]) -> dict[str, Any]:
    kv_bytes = sum(t.numel() * t.element_size() for c in runner.kv.layer_caches() for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None)
    return {
        "pid": os.getpid(),
        "num_blocks": runner.kv.num_blocks,
        "param_bytes": parameter_bytes(runner.model),
        "kv_bytes": kv_bytes,
        "rss_before_load": rss_before_load,
        "rss": resident_bytes(),
    }


def unpack(payload: torch.Tensor, t: int, b: int, w: int, r: int) -> tuple[StepBatch, list[int]]:
    ids, pos, slots, qsl, seq, ctx, lens, tables, rows = payload.split([t, t, t, b + 1, b, b, b, b * w, r])
    seq_cpu = seq.tolist()
    qsl_cpu = qsl.tolist()
    query_lens = [qsl_cpu[i + 1] - qsl_cpu[i] for i in range(b)]
    meta = AttentionMetadata(
        num_tokens=t,
        query_start_loc=qsl.to(torch.int32),
        seq_lens=seq.to(torch.int32),
        context_lens=ctx.to(torch.int32),
        slot_mapping=slots,
        block_tables=tables.to(torch.int32).view(b, w),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_cpu,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_cpu),
        request_lens=lens.to(torch.int32),
    )
    return StepBatch(ids, pos, meta), rows.tolist()


def main(rank: int, world_size: int, pipeline: dict[str, Any], port: int, backend: str, timeout_s: float, conn, num_threads: int) -> None:
    """The worker process's entry point; never returns (``os._exit``)."""
    code = 0
    try:
        torch.set_num_threads(num_threads)
        tp = TPGroup(rank, world_size)
        runner, rss_before = build_shard(pipeline, tp)
        release_free_memory()
        conn.send(("ready", shard_stats(runner, rss_before)))
        tp.connect("127.0.0.1", port, backend, timeout_s)
        comm_device = runner.device if backend == "nccl" else torch.device("cpu")
        kv = KVReplica(runner.kv)
        with torch.inference_mode():
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # rank 0 is gone
                    break
                if msg[0] == "step":
                    _, t, b, w, r, copies = msg
                    payload = tp.broadcast(torch.empty(3 * t + 4 * b + 1 + b * w + r, dtype=torch.int64, device=comm_device))
                    kv.replay(copies)
                    batch, rows = unpack(payload.to(runner.device), t, b, w, r)
                    runner.execute(batch, rows)
                elif msg[0] == "stats":
                    conn.send(("stats", shard_stats(runner, rss_before)))
                elif msg[0] == "stop":
                    break
    except BaseException:  # noqa: BLE001 - report anything, then exit non-zero
        code = 1
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc(limit=8)}"))
        except Exception:  # noqa: BLE001 - rank 0 may be gone
            pass
    os._exit(code)  # skip interpreter teardown: a broken process group must not block or abort the exit
