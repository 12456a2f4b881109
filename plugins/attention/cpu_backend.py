"""Attention backend ``cpu``: a compiled paged-attention kernel, SDPA for what it leaves.

The ``torch`` backend gathers every decode request's KV blocks into a padded tensor per
layer before SDPA: on a CPU that copy, plus the padding, costs more than the attention
itself. Here, rows of requests scheduled with at most ``max_query_len`` tokens go to
``cpu_paged_attention.cpp``, which reads K/V straight from the blocks once per KV head
(GQA without copies) with an online softmax, parallel over tokens x KV heads on torch's
OpenMP threads. With AVX-512 (head_dim 64 or 128) it takes runs of a request's rows as
tiles, which beats SDPA's flash kernel on prefill chunks too, so by default every request
goes there; without, chunks longer than 16 tokens keep the ``torch`` path (SDPA).
Float32 and bfloat16 caches and the int8 cache are read directly.

Per layer (:meth:`for_layer`) the kernel takes a sliding window and logit soft-capping;
chunks left to SDPA get the window as a mask and soft-capping as the ``torch`` backend's
masked matmul.

The kernel is compiled with the machine's C++ compiler on first use (about a second,
then cached); without one the backend refuses to start and says so, and
``attention: {plugin: auto}`` falls back to ``torch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
import torch

from modserve.core.contract import AttentionBackend, AttentionMetadata, AttentionSpec, BuildContext, LayerKVCache, hookimpl
from modserve.plugins.attention import cpu_kernel_build as kernel
from modserve.plugins.attention.torch_backend import PrefillChunk, layer_view, plan_prefills, run_prefills, write_kv
from modserve.plugins.platforms.cpu import cpu_model_and_flags

MODSERVE_CONTRACT = "2.0"


@dataclass
class _KernelRows:
    rows: torch.Tensor  # int64 [N]: token rows handled by the kernel
    seq: torch.Tensor  # int32 [N]: each row's request (row of block_tables)
    pos: torch.Tensor  # int32 [N]: each row's position; it attends to cache positions 0..pos


_NO_ROWS = _KernelRows(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32))


@dataclass
class _StepState:
    kernel: _KernelRows | None
    prefills: list[PrefillChunk]
    block_tables: torch.Tensor  # int32, contiguous


class CpuAttention(AttentionBackend):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        # Requests scheduled with at most this many tokens in a step use the kernel; longer
        # prefill chunks use SDPA. Default: 160 for bfloat16 on a CPU with AMX-BF16 (SDPA's
        # flash kernel runs its products on AMX tiles and wins above ~160 tokens: 1.36x the
        # kernel at 256, 2.8x at 1024); else every request where the kernel has its tiled
        # AVX-512 path for the model's head_dim (3.4x SDPA on 256-token chunks in float32,
        # 5.3x in bfloat16 without AMX), else 16 (the portable loops lose to SDPA's flash
        # kernel on long causal blocks).
        max_query_len: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None

    window: int | None = None  # this layer's sliding window (set by for_layer)
    softcap: float | None = None  # this layer's logit soft-cap

    def __init__(self, config: Config, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        spec = self.spec
        _check_spec(spec)
        self.gqa = spec.num_heads != spec.num_kv_heads
        self.max_query_len = config.max_query_len or default_max_query_len(spec)

    def for_layer(self, sliding_window: int | None = None, logit_softcap: float | None = None) -> CpuAttention:
        return layer_view(self, sliding_window, logit_softcap)

    def prepare(self, meta: AttentionMetadata) -> None:
        limit = self.max_query_len
        rows, seq, pos = [], [], []
        starts = meta.query_start_loc.tolist()
        for i, q_len in enumerate(meta.query_lens_cpu):
            if q_len <= limit:
                first = meta.seq_lens_cpu[i] - q_len
                rows += range(starts[i], starts[i] + q_len)
                seq += [i] * q_len
                pos += range(first, first + q_len)
        kernel_rows = None
        if rows:
            kernel_rows = _KernelRows(
                torch.tensor(rows, dtype=torch.int64),
                torch.tensor(seq, dtype=torch.int32),
                torch.tensor(pos, dtype=torch.int32),
            )
        prefills = plan_prefills(meta, self.spec.block_size, skip=lambda q_len: q_len <= limit)
        meta.backend_state = _StepState(kernel_rows, prefills, meta.block_tables.to(torch.int32).contiguous())

    def forward(self, q, k, v, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """One kernel call writes the step's K/V rows into the cache and attends for the
        kernel's rows, reading q and writing out in the model's dtype (a quantized cache is
        written by ``write_kv`` first); chunks beyond ``max_query_len`` then go to SDPA."""
        state: _StepState = meta.backend_state
        out = torch.empty(q.shape, dtype=q.dtype)
        new_kv = None
        if cache.quantized:
            write_kv(k, v, cache, meta.slot_mapping)
        else:
            new_kv = (k, v, meta.slot_mapping)
        r = state.kernel or _NO_ROWS
        kernel.paged_attention(
            q, out, cache.k, cache.v, cache.k_scale, cache.v_scale, state.block_tables, r.rows, r.seq, r.pos,
            self.spec.scale, new_kv=new_kv, window=self.window, softcap=self.softcap,
        )  # fmt: skip
        run_prefills(q, k, v, cache, state.prefills, out, self.spec.scale, self.gqa, self.window, self.softcap)
        return out


AMX_SDPA_FROM = 161  # prefill chunks this long go to SDPA on AMX-BF16 (measured crossover ~160 tokens)


def default_max_query_len(spec: AttentionSpec) -> int:
    """The longest chunk the kernel takes by default, by what the machine computes fastest."""
    if not kernel.tiled(spec.head_dim):
        return 16
    if spec.dtype == torch.bfloat16 and "amx_bf16" in cpu_model_and_flags()[1]:
        return AMX_SDPA_FROM - 1
    return 4096


def _check_spec(spec: AttentionSpec) -> None:
    """Refuse what the kernel was not built for, naming the alternative."""
    if torch.device(spec.device).type != "cpu":
        raise ValueError(f"attention plugin 'cpu' runs on the CPU only, not on {spec.device}; use 'triton' or 'torch'")
    if spec.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"attention plugin 'cpu' supports float32 and bfloat16 models, not {spec.dtype}; "
            "use `attention: {plugin: torch}`"
        )
    max_group, max_head_dim, max_block = kernel.limits()  # compiles the kernel: fails here, at start-up
    if spec.num_heads % spec.num_kv_heads or spec.num_heads // spec.num_kv_heads > max_group:
        raise ValueError(
            f"attention plugin 'cpu': num_heads {spec.num_heads} must be a multiple of num_kv_heads "
            f"{spec.num_kv_heads}, at most {max_group} query heads per KV head"
        )
    if spec.head_dim > max_head_dim or spec.block_size > max_block:
        raise ValueError(
            f"attention plugin 'cpu' supports head_dim <= {max_head_dim} and block_size <= {max_block}, "
            f"got head_dim {spec.head_dim}, block_size {spec.block_size}; use `attention: {{plugin: torch}}`"
        )


@hookimpl
def register_attention_backends():
    return {"cpu": CpuAttention}
