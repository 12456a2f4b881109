"""Attention backend ``vendor_skeleton``: the shape of a hardware vendor's attention plugin.

It runs today by delegating to a registered portable backend (``fallback``, the ``torch``
backend by default) and marks, in ``__init__``, ``prepare`` and ``forward``, exactly where
a device kernel takes over. It counts its calls, which is also how the tests prove the
engine really routes attention through an out-of-tree backend.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from modserve.core.contract import AttentionBackend, AttentionMetadata, BuildContext, LayerKVCache, hookimpl

MODSERVE_CONTRACT = "2.0"
NAME = "vendor_skeleton"

log = logging.getLogger("modserve_vendor_attention")


class VendorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the vendor skeleton."""

    # Log each step's batch and each layer's q/k/v shapes (debugging: logs per layer).
    log_shapes: bool = False
    # Registered attention backend that serves what the device kernel does not (built with its defaults).
    fallback: str = "torch"

    def __post_init__(self) -> None:
        if self.fallback == NAME:
            raise ValueError(f"fallback: must name another attention backend, not {NAME!r}")


class VendorAttention(AttentionBackend):
    """Delegates to ``fallback``; the comments mark where device kernels replace it."""

    Config = VendorConfig

    def __init__(self, config: VendorConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)  # sets self.spec: heads, head size, dtype, device, the KV backend's block size
        # DEVICE KERNEL, set-up: check this model fits the kernels (spec.head_dim, spec.dtype,
        # spec.block_size, spec.num_heads % spec.num_kv_heads == 0) on this device
        # (spec.device, or ctx.platform for the whole device), load them (e.g. ``torch.ops.load_library(...)``) and keep the ops.
        # Raise ValueError naming the unsupported setting rather than running slowly.
        self.fallback = _build_fallback(config.fallback, ctx)
        self.num_prepare_calls = 0  # engine steps
        self.num_forward_calls = 0  # steps x layers

    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, before the first layer."""
        self.num_prepare_calls += 1
        if self.config.log_shapes:
            batch = (meta.num_tokens, len(meta.seq_lens_cpu), meta.query_lens_cpu)
            log.info("step: %d tokens, %d requests, query lens %s", *batch)
        # DEVICE KERNEL, per-step plan: build the launch plan every layer reuses (tile
        # schedule over meta.query_start_loc, split-K partitions for long decodes from
        # meta.seq_lens_cpu, device copies of meta.block_tables) into meta.backend_state.
        self.fallback.prepare(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.num_forward_calls += 1
        if self.config.log_shapes:
            shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(cache.k.shape))
            log.info("layer: q %s k %s v %s cache %s", *shapes)
        # DEVICE KERNEL, per layer, two launches:
        #   1. write: scatter k/v rows [T, KVH, D] into cache.k/cache.v at meta.slot_mapping
        #      (slot s = row s % block_size of block s // block_size); when cache.quantized,
        #      store int8 values with one float32 scale per token and head in cache.k_scale/v_scale.
        #   2. attend: varlen causal paged attention. Request i's queries are rows
        #      meta.query_start_loc[i]:[i+1]; its keys are positions 0..meta.seq_lens[i]-1
        #      read through meta.block_tables[i]; scale by self.spec.scale; GQA maps query
        #      head h to KV head h // (num_heads // num_kv_heads). Return [T, num_heads, D].
        return self.fallback.forward(q, k, v, cache, meta)


def _build_fallback(name: str, ctx: BuildContext) -> AttentionBackend:
    """The fallback backend, built through the engine's own registry with its default options."""
    backends = ctx.registry.implementations("attention_backends")
    if name not in backends:
        available = ", ".join(sorted(backends))
        raise ValueError(f"attention.fallback: unknown attention backend {name!r}; available: {available}")
    cls = backends[name].cls
    return cls(cls.Config(), ctx)


@hookimpl
def register_attention_backends():
    return {NAME: VendorAttention}
