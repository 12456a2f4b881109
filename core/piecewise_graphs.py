"""Steps that no decode graph replays, run as graph pieces between eager attention calls.

Why: online, almost every step holds some request's prompt chunk beside the decodes, so the
decode graphs (:mod:`modserve.core.decode_graphs`) rarely replay and the step runs eagerly:
hundreds of kernel launches, ~20 ms a step for SmolLM2 on an H100 whose graph replays in
3-5 ms. Of a forward, only attention depends on the step's layout (how many prompts, how
long, where their K/V live); the rest is the same operators on ``T`` rows. So a forward of
``T`` tokens is captured as pieces cut at each attention call (embedding to the first
attention's inputs, each attention's output to the next one's inputs, the last to the final
norm) and replayed piece, attention (eagerly, with this step's metadata), piece, ... vLLM's
piecewise CUDA graphs cut at the same places.

How: the model is built with :class:`AttentionBoundary` around its attention backend. It
passes every call through, except during a capture, when a call ends the current piece, runs
the attention eagerly (its inputs and output become tensors the pieces share) and starts the
next piece. A step of ``t`` tokens replays the smallest captured size ``T >= t``: rows past
``t`` are padding (token 0 at position 0) that attention never sees (it gets the first ``t``
rows) and that is dropped.

Outside attention a model reads the step only from ``input_ids``, ``positions`` and each
request's length (LongRoPE, ``meta.request_lens`` over ``meta.query_start_loc``: contract
2.7). The capture hands the model one pseudo-request per token, so that each of those is a
per-token buffer the pieces read, refilled every step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from modserve.core.contract import AttentionBackend, AttentionMetadata, CausalLM, KVBackend, LayerKVCache, PieceRecorder, Platform
from modserve.core.graph_buckets import GraphBuckets

if TYPE_CHECKING:
    from modserve.core.runner import StepBatch

log = logging.getLogger("modserve.engine")


class AttentionBoundary(AttentionBackend):
    """The attention backend as the model sees it where pieces may be captured: each call
    passes through to ``inner``, except while :attr:`capture` is set, when it is a cut."""

    def __init__(self, inner: AttentionBackend, root: AttentionBoundary | None = None) -> None:
        # a wrapper the core builds, not a plugin: no Plugin.__init__(config, ctx)
        self.inner = inner  # its config, spec and the rest come through __getattr__
        self.capturable = inner.capturable  # a class attribute of the base, which __getattr__ never sees
        self.root = root or self  # per-layer views share the root's capture
        self.capture: _Capture | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self.inner.prepare(meta)

    def for_layer(self, sliding_window: int | None = None, logit_softcap: float | None = None) -> AttentionBackend:
        return AttentionBoundary(self.inner.for_layer(sliding_window, logit_softcap), self.root)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        capture = self.root.capture
        if capture is None:
            return self.inner.forward(q, k, v, cache, meta)
        return capture.cut(self.inner, q, k, v, cache, meta)

    def __getattr__(self, name: str) -> Any:  # anything else is the backend's own (its kernels, its window)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclass
class _Hole:
    """One attention call between two pieces: its inputs and output are the pieces' tensors."""

    backend: AttentionBackend
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: LayerKVCache
    out: torch.Tensor

    def run(self, rows: int, meta: AttentionMetadata) -> None:
        self.out[:rows].copy_(self.backend.forward(self.q[:rows], self.k[:rows], self.v[:rows], self.cache, meta))


@dataclass
class _Capture:
    """A forward being captured: the pieces so far and the attention calls between them."""

    recorder: PieceRecorder
    pieces: list = field(default_factory=list)  # replay() of each piece
    holes: list[_Hole] = field(default_factory=list)

    def cut(self, backend: AttentionBackend, q, k, v, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        self.pieces.append(self.recorder.stop())
        out = backend.forward(q, k, v, cache, meta)  # eagerly, over padding rows: writes no K/V
        self.holes.append(_Hole(backend, q, k, v, cache, out))
        self.recorder.start()
        return out


@dataclass
class _Pieces:
    """A captured size: pieces, the attention between them, and the forward's output tensor."""

    pieces: list
    holes: list[_Hole]
    out: torch.Tensor

    def replay(self, rows: int, meta: AttentionMetadata) -> torch.Tensor:
        for piece, hole in zip(self.pieces, self.holes):
            piece()
            hole.run(rows, meta)
        self.pieces[-1]()
        return self.out[:rows]


def piece_refusal(
    platform: Platform, model: CausalLM | None, attention: AttentionBackend, tensor_parallel: bool
) -> str | None:  # fmt: skip
    """Why steps cannot replay graph pieces here (None: they can; ``model`` None: not built yet)."""
    if not platform.piece_token_sizes():
        return f"platform {type(platform).__name__} captures no graph pieces"
    if tensor_parallel:
        return "tensor parallelism (the workers' forward is not captured)"
    if not attention.capturable:  # the capture's attention calls run over rows whose slot is -1
        return f"attention backend {type(attention).__name__} is not capturable"
    if model is not None and not model.capturable:
        return f"model {type(model).__name__} is not capturable"
    return None


class PiecewiseGraphs(GraphBuckets):
    """Captures and replays forwards as pieces; :meth:`run` returns None for a step it does not take."""

    def __init__(
        self, platform: Platform, model: CausalLM, boundary: AttentionBoundary, kv: KVBackend, device: torch.device
    ) -> None:  # fmt: skip
        super().__init__(platform.piece_token_sizes())
        self.platform, self.model, self.boundary, self.kv = platform, model, boundary, kv
        n = self.sizes[-1]
        on = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, **on)
        self.positions = torch.zeros(n, dtype=torch.int64, **on)
        self.token_lens = torch.ones(n, dtype=torch.int32, **on)  # each token's request length
        self.token_starts = torch.arange(n + 1, dtype=torch.int32, **on)  # one pseudo-request per token
        # the capture's attention: every row a one-token request at position 0 of block 0, writing no K/V
        self.no_slots = torch.full((n,), -1, dtype=torch.int64, **on)
        self.ones = torch.ones(n, dtype=torch.int32, **on)
        self.zeros = torch.zeros(n, dtype=torch.int32, **on)
        self.block_zero = torch.zeros(n, 1, dtype=torch.int32, **on)

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """Hidden states ``[t, hidden]`` of the step from its pieces (attention already
        prepared for it); None where no captured size holds it (the caller runs it eagerly)."""
        rows = batch.meta.num_tokens
        if (found := self._replay_for(rows)) is None:
            return None
        size, pieces = found
        self._load(batch, rows)
        self.replays[size] += 1
        return pieces.replay(rows, batch.meta)

    def _load(self, batch: StepBatch, rows: int) -> None:
        meta = batch.meta
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        if meta.request_lens is None:
            self.token_lens[:rows] = 1  # LongRoPE then goes by position alone, as the eager forward does
        else:
            self.token_lens[:rows].copy_(torch.repeat_interleave(meta.request_lens, meta.query_start_loc.diff(),
                                                                output_size=rows))  # fmt: skip
        self._loaded_rows(rows)

    def _pad(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.token_lens[start:end] = 1

    def _capture(self, size: int) -> _Pieces | None:
        """Two eager warm-up forwards over ``size`` padding rows, then one captured in pieces."""
        recorder = self.platform.piece_recorder()
        if recorder is None:
            self.unavailable = f"platform {type(self.platform).__name__} declined to capture pieces"
            log.warning("graph pieces: %s; such steps run eagerly", self.unavailable)
            return None
        self._pad(0, self.sizes[-1])
        self._loaded = 0
        meta = AttentionMetadata(
            num_tokens=size, query_start_loc=self.token_starts[: size + 1], seq_lens=self.ones[:size],
            context_lens=self.zeros[:size], slot_mapping=self.no_slots[:size], block_tables=self.block_zero[:size],
            query_lens_cpu=[1] * size, seq_lens_cpu=[1] * size, max_query_len=1, max_seq_len=1,
            request_lens=self.token_lens[:size],
        )  # fmt: skip
        self.boundary.prepare(meta)
        args = (self.input_ids[:size], self.positions[:size], self.kv.layer_caches(), meta)
        t0 = time.perf_counter()
        with recorder:
            for _ in range(2):  # kernels compile and pick their algorithms outside the capture
                self.model(*args)
            capture = self.boundary.capture = _Capture(recorder)
            try:
                recorder.start()
                out = self.model(*args)
                capture.pieces.append(recorder.stop())
            finally:
                self.boundary.capture = None
        log.info("graph pieces: captured %d tokens as %d pieces in %.2f s", size, len(capture.pieces), time.perf_counter() - t0)
        self.captured[size] = pieces = _Pieces(capture.pieces, capture.holes, out)
        return pieces
