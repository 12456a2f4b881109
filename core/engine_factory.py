"""Builds an engine's parts from a pipeline config: validate, load the model, pick plugins."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from modserve.core.config import PipelineConfig, load_pipeline
from modserve.core.cpu_memory import keep_freed_memory
from modserve.core.interfaces import AttentionSpec, KVSpec, SchedulerLimits
from modserve.core.models.loader import ModelSource, load_model, locate
from modserve.core.models.spec import ModelSpec
from modserve.core.plugin_manager import PluginRegistry, default_registry
from modserve.core.runner import ModelRunner
from modserve.core.speculative_base import ProposerContext
from modserve.core.tokenizer import TokenizerBundle

log = logging.getLogger("modserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ResolvedPipeline:
    """A validated pipeline: config plus the implementation class and options of each plugin."""

    pipeline: PipelineConfig
    plugins: dict[str, tuple[type, msgspec.Struct]]
    source: ModelSource
    registry: PluginRegistry


def resolve(source: Any = None, registry: PluginRegistry | None = None, **overrides: Any) -> ResolvedPipeline:
    """Validate everything that can be checked without loading weights (``modserve validate``)."""
    pipeline = load_pipeline(source, **overrides)
    registry = registry or default_registry()
    plugins = {}
    for section in ("scheduler", "kv_cache", "attention", "sampler", "speculative"):
        raw = getattr(pipeline, section)
        if section == "attention" and isinstance(raw, dict) and raw.get("plugin") == "auto":
            raw = pipeline.attention = {**raw, "plugin": auto_attention(pipeline.device, pipeline.model.dtype)}
        if raw is not None:
            plugins[section] = registry.resolve(section, raw)
    return ResolvedPipeline(pipeline, plugins, locate(pipeline.model.path), registry)


@dataclass
class EngineComponents:
    pipeline: PipelineConfig
    registry: PluginRegistry
    spec: ModelSpec
    tokenizer: TokenizerBundle
    model_name: str
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    kv: Any
    scheduler: Any
    sampler: Any
    attention: Any
    runner: ModelRunner
    proposer: Any = None

    def chosen_plugins(self) -> dict[str, tuple[str, Any]]:
        """``{section: (plugin name, object)}`` for fault messages."""
        p = self.pipeline
        objects = {"scheduler": self.scheduler, "kv_cache": self.kv, "attention": self.attention,
                   "sampler": self.sampler, "speculative": self.proposer}
        return {s: (getattr(p, s)["plugin"], obj) for s, obj in objects.items() if obj is not None}

    def info(self) -> dict[str, Any]:
        p = self.pipeline
        return {
            "model_name": self.model_name,
            "num_blocks": self.kv.num_blocks,
            "block_size": self.kv.block_size,
            "plugins": {s: (getattr(p, s) or {}).get("plugin") for s in ("scheduler", "kv_cache", "attention", "sampler", "speculative")},
        }


def auto_attention(device: str, dtype: str = "auto") -> str:
    """``attention: {plugin: auto}``: Triton kernels on CUDA; on the CPU the compiled ``cpu``
    kernel where a C++ compiler can build it (float32/bfloat16), else the ``torch`` backend."""
    if pick_device(device).type == "cuda":
        return "triton"
    if dtype == "float16":
        return "torch"
    from modserve.plugins.attention import cpu_kernel_build

    try:
        cpu_kernel_build.load()
    except cpu_kernel_build.KernelUnavailable as e:
        log.warning("attention auto: %s; using the torch backend", e)
        return "torch"
    return "cpu"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' requested but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def build_components(source: Any = None, registry: PluginRegistry | None = None, **overrides: Any) -> EngineComponents:
    """Each engine gets its own registry unless given one, so observers added to it stay its own.

    With ``parallel.tensor_parallel_size > 1`` this process becomes rank 0: the worker
    processes start loading their shards first, then rank 0 loads its own.
    """
    r = resolve(source, registry or PluginRegistry(), **overrides)
    if r.pipeline.parallel.tensor_parallel_size == 1:
        return _build(r, None)
    from modserve.core.distributed.tp_runner import start_workers

    workers = start_workers(r, pick_device(r.pipeline.device))
    try:
        return _build(r, workers)
    except BaseException:
        workers.stop(grace_s=0)
        raise


def _build(r: ResolvedPipeline, workers) -> EngineComponents:
    p = r.pipeline
    n = p.parallel.tensor_parallel_size  # > 1: this process is rank 0 and holds one shard of n
    device = pick_device(p.device)
    dtype = pick_dtype(p.model.dtype, device)
    att_cls, att_cfg = r.plugins["attention"]
    kv_cls, kv_cfg = r.plugins["kv_cache"]
    block_size = getattr(kv_cfg, "block_size", 16)
    holder: dict[str, Any] = {}

    def make_attention(spec: ModelSpec, shards: int = 1):
        holder["attention"] = att_cls(
            att_cfg,
            AttentionSpec(spec.num_heads // shards, spec.num_kv_heads // shards, spec.head_dim, spec.head_dim**-0.5, dtype, device, block_size),
        )
        return holder["attention"]

    if device.type == "cpu" and p.model.reuse_cpu_memory:
        keep_freed_memory()
    tp = workers.tp if workers is not None else None
    loaded = load_model(
        r.source, lambda spec: make_attention(spec, n), dtype, device, p.model.max_model_len, p.model.tokenizer, tp=tp,
        pack_weights=p.model.pack_cpu_weights,
        fuse_ops=p.model.fuse_cpu_ops,
    )
    spec = loaded.spec
    max_model_len = p.model.max_model_len or spec.max_position_embeddings
    if spec.sliding_window and max_model_len > spec.sliding_window:
        raise ValueError(
            f"model.max_model_len: {max_model_len} exceeds the model's sliding window {spec.sliding_window}, "
            "which modserve does not implement; set max_model_len <= the window"
        )
    kv = kv_cls(kv_cfg, KVSpec(spec.num_layers, spec.num_kv_heads // n, spec.head_dim, dtype, device, max_model_len))
    sched_cls, sched_cfg = r.plugins["scheduler"]
    scheduler = sched_cls(sched_cfg, kv, SchedulerLimits(max_model_len))
    samp_cls, samp_cfg = r.plugins["sampler"]
    sampler = samp_cls(samp_cfg, spec.vocab_size)
    if workers is None:
        runner = ModelRunner(loaded.model, kv, holder["attention"], device)
    else:
        from modserve.core.distributed.tp_runner import TPModelRunner

        workers.wait_ready(kv.num_blocks)
        runner = TPModelRunner(loaded.model, kv, holder["attention"], device, workers)
    proposer = None
    if "speculative" in r.plugins:
        spec_cls, spec_cfg = r.plugins["speculative"]
        ctx = ProposerContext(spec, r.source, loaded.model, loaded.tokenizer, dtype, device, max_model_len, make_attention)
        proposer = spec_cls(spec_cfg, ctx)
    return EngineComponents(
        pipeline=p,
        registry=r.registry,
        spec=spec,
        tokenizer=loaded.tokenizer,
        model_name=p.model.name or r.source.default_name,
        max_model_len=max_model_len,
        device=device,
        dtype=dtype,
        kv=kv,
        scheduler=scheduler,
        sampler=sampler,
        attention=holder["attention"],
        runner=runner,
        proposer=proposer,
    )
