"""Decode steps replayed from captured graphs (CUDA graphs), one graph per batch-size bucket.

Why: a small model's decode step on a GPU is hundreds of kernels of a few microseconds each,
and launching them from Python costs more than running them. A graph captured once per
batch size replays the whole forward in one launch.

Which steps: every request has exactly one query token (no prefill chunk, no draft tokens),
at most the largest size the platform names (:meth:`Platform.graph_batch_sizes`), and the
model and attention backend declare themselves ``capturable`` (contract 2.5). A step of
``b`` requests runs the graph of the smallest size ``>= b``: rows past ``b`` are padding that
writes no K/V (slot -1), attends to one position of block 0 and is dropped. Anything else
runs eagerly, as before.

The graphs share one set of input tensors, sized for the largest bucket (a bucket reads the
first rows), which each step's batch is copied into. A graph is captured the first time its
size is needed (a server captures every size at start-up: :meth:`GraphBuckets.capture_all`),
with the attention backend prepared for ``max_model_len`` long rows, so the
plan it captured (e.g. the Triton decode's split-K partitions) serves any length. The KV
backend's layer caches must stay the same tensors for the engine's life (every shipped
backend allocates them once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from modserve.core.contract import AttentionBackend, AttentionMetadata, CausalLM, KVBackend, Platform
from modserve.core.graph_buckets import GraphBuckets

if TYPE_CHECKING:
    from modserve.core.runner import StepBatch

log = logging.getLogger("modserve.engine")


def graph_refusal(platform: Platform, model: CausalLM, attention: AttentionBackend, tensor_parallel: bool) -> str | None:
    """Why decode steps cannot replay graphs here (None: they can)."""
    if not platform.graph_batch_sizes():
        return f"platform {type(platform).__name__} captures no graphs"
    if tensor_parallel:
        return "tensor parallelism (the workers' forward is not captured)"
    if not attention.capturable:
        return f"attention backend {type(attention).__name__} is not capturable"
    if not model.capturable:
        return f"model {type(model).__name__} is not capturable"
    return None


class DecodeGraphs(GraphBuckets):
    """Captures and replays decode-only steps; :meth:`run` returns None for any other step."""

    def __init__(
        self, platform: Platform, model: CausalLM, attention: AttentionBackend, kv: KVBackend,
        device: torch.device, max_model_len: int,
    ) -> None:  # fmt: skip
        super().__init__(platform.graph_batch_sizes())
        self.platform, self.model, self.attention, self.kv = platform, model, attention, kv
        self.max_model_len = max_model_len
        n, width = self.sizes[-1], -(-max_model_len // kv.block_size)
        on = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, **on)
        self.positions = torch.zeros(n, dtype=torch.int64, **on)
        self.slots = torch.full((n,), -1, dtype=torch.int64, **on)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **on)
        self.context_lens = torch.zeros(n, dtype=torch.int32, **on)
        self.request_lens = torch.ones(n, dtype=torch.int32, **on)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, **on)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **on)

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Hidden states ``[b, hidden]`` of a decode-only step from its graph; None where the
        step is not one (the caller runs it eagerly)."""
        meta = batch.meta
        rows = meta.num_tokens
        if meta.max_query_len != 1 or len(meta.query_lens_cpu) != rows:
            return None
        if meta.block_tables.shape[1] > self.block_tables.shape[1] or (found := self._replay_for(rows)) is None:
            return None
        size, replay = found
        self._load(batch, rows)
        self.replays[size] += 1
        return replay()[:rows]

    def _load(self, batch: StepBatch, rows: int) -> None:
        """Copy the step into the first ``rows`` rows; rows the last step used past them go back
        to padding."""
        meta = batch.meta
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.slots[:rows].copy_(meta.slot_mapping)
        self.seq_lens[:rows].copy_(meta.seq_lens)
        self.context_lens[:rows].copy_(meta.context_lens)
        self.request_lens[:rows].copy_(meta.seq_lens if meta.request_lens is None else meta.request_lens)
        self.block_tables[:rows, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self._loaded_rows(rows)

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start:end`` as padding: token 0 at position 0, no K/V written, one key of block 0."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = -1
        self.seq_lens[start:end] = 1
        self.context_lens[start:end] = 0
        self.request_lens[start:end] = 1
        self.block_tables[start:end] = 0

    def _capture(self, size: int) -> Callable[[], torch.Tensor] | None:
        """Capture the forward over ``size`` padded rows (the capture's warm-up runs write no K/V)."""
        self._pad(0, self.sizes[-1])
        self._loaded = 0
        meta = AttentionMetadata(
            num_tokens=size, query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size], slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size], query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size, max_query_len=1, max_seq_len=self.max_model_len,
            request_lens=self.request_lens[:size],
        )  # fmt: skip
        self.attention.prepare(meta)
        t0 = time.perf_counter()
        replay = self.platform.capture_graph(
            self.model, (self.input_ids[:size], self.positions[:size], self.kv.layer_caches(), meta)
        )
        if replay is None:
            self.unavailable = f"platform {type(self.platform).__name__} declined to capture"
            log.warning("decode graphs: %s; decode steps run eagerly", self.unavailable)
            return None
        log.info("decode graphs: captured batch size %d in %.2f s", size, time.perf_counter() - t0)
        self.captured[size] = replay
        return replay
