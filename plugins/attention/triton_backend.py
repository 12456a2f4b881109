"""Triton attention backend: paged KV write, varlen causal prefill and split-K decode kernels.

Importing this module never imports triton, so the plugin registers everywhere; building
the backend imports the kernels and refuses a CPU device unless the interpreter is on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import torch

from modserve.core.contract import AttentionBackend, AttentionMetadata, AttentionSpec, BuildContext, LayerKVCache, hookimpl

MODSERVE_CONTRACT = "2.5"  # capturable


@dataclass
class _StepPlan:
    """Launch plan for one step, built in ``prepare`` and shared by every layer."""

    prefill_tiles: torch.Tensor | None  # [N, 2] int32: (request, first query index) of each tile
    decode_reqs: torch.Tensor | None  # [Bd] int32: requests with exactly one query token
    partials: tuple[torch.Tensor, torch.Tensor] | None  # split-K scratch: o [Bd, H, S, D], lse [Bd, H, S]


class TritonAttention(AttentionBackend):
    """Attention through Triton kernels (CUDA/ROCm; CPU only under ``TRITON_INTERPRET=1``).

    Per layer (:meth:`for_layer`) the kernels take a sliding window and logit soft-capping."""

    window: int | None = None  # this layer's sliding window (set by for_layer)
    softcap: float | None = None  # this layer's logit soft-cap
    # Decode reads only tensors (the split count from the plan's scratch, each row's length
    # from seq_lens; empty partitions weigh nothing) and write_kv skips slot -1.
    capturable = True

    class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
        """Tile sizes and the decode split-K policy."""

        # Prefill tile rows: query tokens x the query heads sharing one KV head. Each K/V
        # tile fetched serves this many rows, so it sets the kernel's FLOPs per byte.
        prefill_block_m: Literal[16, 32, 64, 128] = 128
        # Keys per tile in both attention kernels.
        block_n: Literal[16, 32, 64, 128] = 64
        # Most partitions one decode context is split into (1 turns split-K off).
        decode_max_splits: Annotated[int, msgspec.Meta(ge=1, le=64)] = 16
        # Context tokens per decode partition: a step uses cdiv(longest decode context, this) splits.
        decode_split_tokens: Annotated[int, msgspec.Meta(ge=16)] = 256
        # Decode programs (requests x KV heads x partitions) that fill the device: a step has at
        # most this many over its requests' programs partitions, and none once those reach it
        # (splitting then only adds partials to merge: on an H100, 8B heads, one partition beat
        # two or more at 16, 64 and 256 requests of 450 and 2,048 positions). None: one program per
        # streaming multiprocessor (FILL_PROGRAMS_PER_SM); no limit on the CPU.
        decode_fill_programs: Annotated[int, msgspec.Meta(ge=1)] | None = None

    def __init__(self, config: Config, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        spec = self.spec
        self.kernels = _import_kernels(spec.device)
        _check_spec(spec, self.kernels)
        self.block_q = self.kernels.prefill_block_q(spec.num_heads, spec.num_kv_heads, config.prefill_block_m)
        self.fill_programs = config.decode_fill_programs or fill_programs(spec.device)

    def for_layer(self, sliding_window: int | None = None, logit_softcap: float | None = None) -> TritonAttention:
        from modserve.plugins.attention.torch_backend import layer_view

        return layer_view(self, sliding_window, logit_softcap)

    def prepare(self, meta: AttentionMetadata) -> None:
        """Split the batch into decode rows (one query token) and prefill tiles, once per step."""
        query_lens = meta.query_lens_cpu
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        meta.backend_state = _StepPlan(
            prefill_tiles=self._prefill_tiles(meta),
            decode_reqs=self._index(decode) if decode else None,
            partials=self._split_scratch(len(decode), max((meta.seq_lens_cpu[i] for i in decode), default=0)),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.kernels.write_kv(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        self.attend(q, cache, meta, out)
        return out

    def attend(self, q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Attention over the cache (this step's K/V already written) into ``out [T, H, D]``."""
        if meta.backend_state is None:
            self.prepare(meta)
        plan: _StepPlan = meta.backend_state
        cfg, scale = self.config, self.spec.scale
        if plan.prefill_tiles is not None:
            self.kernels.prefill_attention(q, cache, meta, plan.prefill_tiles, self.block_q, cfg.block_n, scale, out,
                                           self.window, self.softcap)
        if plan.decode_reqs is not None:
            self.kernels.decode_attention(q, cache, meta, plan.decode_reqs, cfg.block_n, scale, out, plan.partials,
                                          self.window, self.softcap)

    def _prefill_tiles(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """(request, first query) per tile of ``block_q`` tokens, heaviest first so long tiles start early."""
        tiles = [
            (seq_len - n + q0, i, q0)
            for i, (n, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu))
            if n > 1
            for q0 in range(0, n, self.block_q)
        ]
        if not tiles:
            return None
        tiles.sort(reverse=True)
        return self._index([(i, q0) for _, i, q0 in tiles])

    def _split_scratch(self, num_decode: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp32 partial outputs for split-K, or None when one partition per request suffices."""
        spec = self.spec
        splits = decode_splits(self.config, num_decode * spec.num_kv_heads, max_seq_len, self.fill_programs)
        if num_decode == 0 or splits <= 1:
            return None
        o = torch.empty(num_decode, spec.num_heads, splits, spec.head_dim, dtype=torch.float32, device=spec.device)
        lse = torch.empty(num_decode, spec.num_heads, splits, dtype=torch.float32, device=spec.device)
        return o, lse

    def _index(self, rows: list) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int32, device=self.spec.device)


FILL_PROGRAMS_PER_SM = 1


def decode_splits(config: TritonAttention.Config, programs: int, max_seq_len: int, fill: int | None) -> int:
    """Partitions per decode row: one per ``decode_split_tokens`` of the longest row, at most
    ``decode_max_splits``, and at most as many times as ``programs`` (requests x KV heads) fit in ``fill``."""
    splits = min(config.decode_max_splits, -(-max_seq_len // config.decode_split_tokens))
    if fill is not None and programs:
        splits = min(splits, fill // programs)
    return max(splits, 1)


def fill_programs(device: torch.device) -> int | None:
    """Programs that fill a GPU (FILL_PROGRAMS_PER_SM per multiprocessor); None off a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return FILL_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _import_kernels(device: torch.device):
    """Import the kernel module, or explain how to make Triton usable here."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "attention plugin 'triton' needs the triton package: `pip install triton` "
            "(or `pip install modserve[triton]`), or use `attention: {plugin: torch}`"
        ) from e
    from modserve.plugins.attention import triton_kernels

    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and (os.environ.get("TRITON_INTERPRET") != "1" or not triton_kernels.INTERPRETED):
        raise RuntimeError(
            "attention plugin 'triton' cannot compile kernels for the CPU: set TRITON_INTERPRET=1 to run "
            "Triton kernels in the interpreter on CPU (slow, for testing), or use `attention: {plugin: torch}`"
        )
    return triton_kernels


def _check_spec(spec: AttentionSpec, kernels) -> None:
    """Reject shapes and dtypes the kernels were not written for, naming what is supported."""
    if spec.head_dim not in kernels.SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"attention plugin 'triton' does not support head size {spec.head_dim}; "
            f"supported head sizes: {', '.join(map(str, kernels.SUPPORTED_HEAD_DIMS))}"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"attention plugin 'triton': num_heads {spec.num_heads} must be a multiple of "
            f"num_kv_heads {spec.num_kv_heads}"
        )
    if spec.dtype not in kernels.SUPPORTED_DTYPES:
        raise ValueError(
            f"attention plugin 'triton' does not support dtype {spec.dtype}; supported: float32, float16, bfloat16"
        )


@hookimpl
def register_attention_backends():
    return {"triton": TritonAttention}
