"""Attention backend ``cpu``: a compiled paged-attention kernel, SDPA for what it leaves.

The ``torch`` backend gathers every decode request's KV blocks into a padded tensor per
layer before SDPA: on a CPU that copy, plus the padding, costs more than the attention
itself. Here, rows of requests scheduled with at most ``max_query_len`` tokens go to
``cpu_paged_attention.cpp``, which reads K/V straight from the blocks once per KV head
(GQA without copies) with an online softmax, parallel over tokens x KV heads on torch's
OpenMP threads. With AVX-512 (head_dim 64 or 128) it takes runs of a request's rows as
tiles, which beats SDPA's flash kernel on prefill chunks too, so by default every request
goes there; without, chunks longer than 16 tokens keep the ``torch`` path (SDPA). On CPUs
with AMX-BF16, bfloat16 chunks over 32 tokens go to ``cpu_amx_attention.cpp`` instead, both
products on AMX tiles (:mod:`cpu_amx_prefill`; ``prefill_kernel: sdpa`` keeps SDPA there).
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
from typing import Annotated, Literal

import msgspec
import torch

from modserve.core.contract import AttentionBackend, AttentionMetadata, AttentionSpec, BuildContext, LayerKVCache, hookimpl
from modserve.plugins.attention import cpu_amx_prefill as amx_prefill
from modserve.plugins.attention import cpu_kernel_build as kernel
from modserve.plugins.attention.torch_backend import PrefillChunk, layer_view, plan_prefills, run_prefills
from modserve.plugins.platforms.cpu import cpu_model_and_flags

MODSERVE_CONTRACT = "2.0"


@dataclass
class _StepState:
    step: kernel.StepRows  # the kernel's rows (token rows, their requests and positions), tables and new rows' slots
    prefills: list[PrefillChunk]


class CpuAttention(AttentionBackend):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        # Requests scheduled with at most this many tokens in a step use the kernel; longer
        # prefill chunks use SDPA (or the AMX prefill kernel). Default: 32 where the AMX
        # prefill kernel runs; 160 for bfloat16 on a CPU with AMX-BF16 otherwise (SDPA's
        # flash kernel runs its products on AMX tiles and wins above ~160 tokens: 1.36x the
        # kernel at 256, 2.8x at 1024); else every request where the kernel has tiles for
        # the model's head_dim (AVX-512: 3.4x SDPA on 256-token chunks in float32, 5.3x in
        # bfloat16 without AMX; AVX2: 1.3-1.5x SDPA in float32), else 16 (the portable loops
        # lose to SDPA's flash kernel on long causal blocks).
        max_query_len: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
        # Longer chunks: causal attention on AMX tiles (bfloat16 model and KV cache, head_dim
        # 64/128, CPUs with AMX-BF16, no sliding window or soft-cap), SDPA's flash kernel, or
        # auto (amx where it runs; SDPA for layers with a window or soft-cap).
        prefill_kernel: Literal["auto", "amx", "sdpa"] = "auto"

    window: int | None = None  # this layer's sliding window (set by for_layer)
    softcap: float | None = None  # this layer's logit soft-cap
    capturable = True  # decode steps: every kernel call is recordable, and reads the step from meta's tensors
    _rows: tuple[torch.Tensor, torch.Tensor] | None = None  # a decode step's rows and their requests: 0..n-1

    def __init__(self, config: Config, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        spec = self.spec
        _check_spec(spec)
        self.gqa = spec.num_heads != spec.num_kv_heads
        self.amx_prefill = _use_amx_prefill(config.prefill_kernel, spec, ctx)
        self.max_query_len = config.max_query_len or default_max_query_len(spec, self.amx_prefill)

    def for_layer(self, sliding_window: int | None = None, logit_softcap: float | None = None) -> CpuAttention:
        if self.config.prefill_kernel == "amx" and (sliding_window is not None or logit_softcap is not None):
            raise ValueError(
                "attention.prefill_kernel: amx takes no sliding window or logit soft-cap, which this model's "
                "layers have; use auto (SDPA for those layers) or sdpa"
            )
        return layer_view(self, sliding_window, logit_softcap)

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.max_query_len == 1 and meta.context_lens.dtype == torch.int32:
            rows, seq, pos = *self._decode_rows(meta.num_tokens), meta.context_lens.contiguous()
            prefills = []
        else:
            rows, seq, pos = self._kernel_rows(meta)
            prefills = plan_prefills(meta, self.spec.block_size, skip=lambda q_len: q_len <= self.max_query_len)
        step = kernel.step_rows(meta.block_tables.to(torch.int32).contiguous(), rows, seq, pos, meta.slot_mapping)
        meta.backend_state = _StepState(step, prefills)

    def _decode_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode-only step's rows and their requests: row i is request i, at position
        ``context_lens[i]``. The kernel then reads positions, block tables and slots from meta's
        own tensors, so a replayed decode graph (:mod:`native_calls`) sees each step's values."""
        if self._rows is None or self._rows[0].numel() != n:
            self._rows = (torch.arange(n, dtype=torch.int64), torch.arange(n, dtype=torch.int32))
        return self._rows

    def _kernel_rows(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token rows of requests scheduled with at most ``max_query_len`` tokens, each
        row's request and position."""
        rows, seq, pos = [], [], []
        starts = meta.query_start_loc.tolist()
        for i, q_len in enumerate(meta.query_lens_cpu):
            if q_len <= self.max_query_len:
                first = meta.seq_lens_cpu[i] - q_len
                rows += range(starts[i], starts[i] + q_len)
                seq += [i] * q_len
                pos += range(first, first + q_len)
        return torch.tensor(rows, dtype=torch.int64), torch.tensor(seq, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)

    def forward(self, q, k, v, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        """One kernel call writes the step's K/V rows into the cache (an int8 cache: quantized
        there, as ``write_kv`` would) and attends for the kernel's rows, reading q and writing
        out in the model's dtype; chunks beyond ``max_query_len`` then go to SDPA."""
        state: _StepState = meta.backend_state
        out = torch.empty(q.shape, dtype=q.dtype)
        kernel.attend(
            state.step, q, out, cache.k, cache.v, cache.k_scale, cache.v_scale, self.spec.scale,
            new_kv=(k, v), window=self.window, softcap=self.softcap,
        )  # fmt: skip
        if not state.prefills:
            return out
        if self.amx_prefill and self.window is None and self.softcap is None:
            amx_prefill.run_prefills(q, k, v, cache, state.prefills, out, self.spec.scale)
        else:
            run_prefills(q, k, v, cache, state.prefills, out, self.spec.scale, self.gqa, self.window, self.softcap)
        return out


AMX_SDPA_FROM = 161  # prefill chunks this long go to SDPA on AMX-BF16 (measured crossover ~160 tokens)
AMX_TILES_FROM = 33  # ... and to the AMX prefill kernel from this length where it runs


def default_max_query_len(spec: AttentionSpec, amx_prefill: bool = False) -> int:
    """The longest chunk the paged kernel takes by default, by what the machine computes fastest.
    With the AMX prefill kernel, chunks over 32 tokens go there (bench roofline at 64 clients,
    AMX Xeon, against SDPA from 161 tokens on: 1.04x; the AMX kernel from 161 on: 1.03x)."""
    if amx_prefill:
        return AMX_TILES_FROM - 1
    if not kernel.tiled(spec.head_dim):
        return 16
    if spec.dtype == torch.bfloat16 and "amx_bf16" in cpu_model_and_flags()[1]:
        return AMX_SDPA_FROM - 1
    return 4096


def _use_amx_prefill(choice: str, spec: AttentionSpec, ctx: BuildContext) -> bool:
    """Whether long prefill chunks run on AMX tiles: ``auto`` where the CPU has AMX-BF16 and the
    kernel serves the model and its KV cache; ``amx`` insists (and says why it cannot)."""
    if choice == "sdpa":
        return False
    why = amx_prefill.unavailable(spec.dtype, spec.head_dim)
    if why is None and ctx.kv is not None and any(c.quantized for c in ctx.kv.layer_caches()[:1]):
        why = "it reads bfloat16 KV caches, not int8 (kv_cache.kv_dtype)"
    if choice == "amx" and why is not None:
        raise ValueError(f"attention.prefill_kernel: amx cannot run here: {why}; use auto or sdpa")
    return why is None


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
