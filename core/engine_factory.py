"""Builds an engine's parts from a pipeline config, every kind as ``cls(config, ctx)``.

Order (each step fills the :class:`~modserve.core.contract.BuildContext` the next reads):
platform -> model spec -> KV backend -> attention (with the KV backend's block size) ->
model -> scheduler -> sampler -> logits processors -> proposer -> output parsers (tool calls,
reasoning; the server reads them) -> observers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from modserve.core.config import PipelineConfig, load_pipeline
from modserve.core.contract import (
    BuildContext,
    CausalLM,
    KVBackend,
    KVSpec,
    LogitsProcessor,
    ModelSpec,
    Observer,
    Platform,
    Proposer,
    ReasoningParser,
    Sampler,
    Scheduler,
    TargetModel,
    ToolParser,
)
from modserve.core.decode_graphs import DecodeGraphs, graph_refusal
from modserve.core.piecewise_graphs import AttentionBoundary, PiecewiseGraphs, piece_refusal
from modserve.core.models.loader import (
    LoadedModel,
    ModelSource,
    build_model,
    check_max_model_len,
    load_model,
    locate,
    open_checkpoint,
)
from modserve.core.plugin_manager import PluginRegistry, default_registry
from modserve.core.runner import ModelRunner
from modserve.core.tokenizer import TokenizerBundle

log = logging.getLogger("modserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SINGLE_SECTIONS = ("scheduler", "kv_cache", "attention", "sampler", "speculative", "tool_parser", "reasoning_parser")
LIST_SECTIONS = ("logits_processors", "observers")


@dataclass
class ResolvedPipeline:
    """A validated pipeline: config, the platform (built: it answers ``auto``), and the
    implementation class and options of every other plugin, by pipeline key
    (``logits_processors[0]``, ``observers[1]`` for list entries)."""

    pipeline: PipelineConfig
    platform: Platform
    dtype: str
    plugins: dict[str, tuple[type, msgspec.Struct]]
    source: ModelSource
    registry: PluginRegistry

    def entries(self, section: str) -> list[str]:
        """The keys of a list section's entries, in order."""
        return [k for k in self.plugins if k.startswith(section + "[")]

    def build(self, key: str, ctx: BuildContext) -> Any:
        cls, config = self.plugins[key]
        return cls(config, ctx)

    def plugin_name(self, key: str) -> str:
        section, _, index = key.partition("[")
        raw = getattr(self.pipeline, section)
        raw = raw[int(index[:-1])] if index else raw
        return raw if isinstance(raw, str) else raw["plugin"]


def resolve(source: Any = None, registry: PluginRegistry | None = None, **overrides: Any) -> ResolvedPipeline:
    """Validate everything that can be checked without loading weights (``modserve validate``)."""
    pipeline = load_pipeline(source, **overrides)
    registry = registry or default_registry()
    device = pipeline.device  # a platform name, or {plugin: name, **options}
    if device == "auto" or (isinstance(device, dict) and device.get("plugin") == "auto"):
        chosen = registry.available_platform()
        device = pipeline.device = {**device, "plugin": chosen} if isinstance(device, dict) else chosen
    platform = registry.create("device", device, BuildContext(registry, pipeline.model.max_model_len))
    dtype = pipeline.model.dtype if pipeline.model.dtype != "auto" else platform.default_dtype()
    if pipeline.attention.get("plugin") == "auto":
        pipeline.attention = {**pipeline.attention, "plugin": platform.default_attention(dtype)}
    plugins = {}
    for section in SINGLE_SECTIONS:
        raw = getattr(pipeline, section)
        if raw is not None:
            plugins[section] = registry.resolve(section, raw)
    for section in LIST_SECTIONS:
        for i, raw in enumerate(getattr(pipeline, section)):
            plugins[f"{section}[{i}]"] = registry.resolve(f"{section}[{i}]", raw)
    return ResolvedPipeline(pipeline, platform, dtype, plugins, locate(pipeline.model.path), registry)


@dataclass
class EngineComponents:
    pipeline: PipelineConfig
    registry: PluginRegistry
    platform: Platform
    spec: ModelSpec
    tokenizer: TokenizerBundle
    model_name: str
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    kv: KVBackend
    scheduler: Scheduler
    sampler: Sampler
    attention: Any
    runner: ModelRunner
    proposer: Proposer | None = None
    tool_parser: ToolParser | None = None  # read by the server, not the engine
    reasoning_parser: ReasoningParser | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    observers: list[Observer] = field(default_factory=list)
    plugin_names: dict[str, str] = field(default_factory=dict)  # pipeline key -> plugin name

    def chosen_plugins(self) -> dict[str, tuple[str, Any]]:
        """``{section: (plugin name, object)}`` for fault messages."""
        objects = {"scheduler": self.scheduler, "kv_cache": self.kv, "attention": self.attention,
                   "sampler": self.sampler, "speculative": self.proposer}
        objects.update({f"logits_processors[{i}]": p for i, p in enumerate(self.logits_processors)})
        return {s: (self.plugin_names[s], obj) for s, obj in objects.items() if obj is not None}

    def info(self) -> dict[str, Any]:
        kv = self.kv.stats()
        return {
            "model_name": self.model_name,
            "num_blocks": kv.num_blocks,
            "block_size": self.kv.block_size,
            "platform": self.plugin_names["device"],
            "plugins": dict(self.plugin_names),
        }


@dataclass
class Shard:
    """What every tensor-parallel rank builds alike: KV backend, attention, model."""

    ctx: BuildContext
    tokenizer: TokenizerBundle
    kv: KVBackend
    attention: Any
    model: CausalLM
    boundary: AttentionBoundary | None = None  # what the model calls where graph pieces may be captured


def build_shard(r: ResolvedPipeline, rank: int = 0, tp=None, model_name: str = "", replica: int | None = None, on_read=None) -> Shard:
    """Platform device -> checkpoint spec -> KV backend -> attention -> model, for one rank.
    ``on_read`` is called just before the weights are read (the workers measure memory there)."""
    p = r.pipeline
    shards = tp.world_size if tp is not None else 1
    device = r.platform.device(rank)
    ctx = BuildContext(r.registry, p.model.max_model_len, model_name, replica, shards, r.platform, device, DTYPES[r.dtype])
    ckpt = open_checkpoint(r.source, ctx, p.model.tokenizer, tp)
    spec = ckpt.spec
    max_model_len = check_max_model_len(spec, p.model.max_model_len)
    kv_spec = KVSpec(spec.num_layers, spec.num_kv_heads // shards, spec.head_dim, ctx.dtype, device, max_model_len)
    ctx = ctx.with_(model=spec, tokenizer=ckpt.tokenizer, max_model_len=max_model_len, kv_spec=kv_spec)
    kv = r.build("kv_cache", ctx)
    ctx = ctx.with_(kv=kv)
    attention = r.build("attention", ctx)
    if on_read is not None:
        on_read()
    boundary = AttentionBoundary(attention) if piece_refusal(r.platform, None, attention, tp is not None) is None else None
    model = build_model(ckpt, boundary or attention, ctx, max_model_len, tp=tp)
    return Shard(ctx, ckpt.tokenizer, kv, attention, model, boundary)


def build_components(
    source: Any = None, registry: PluginRegistry | None = None, replica: int | None = None, **overrides: Any
) -> EngineComponents:
    """Each engine gets its own registry unless given one, so its observers stay its own.

    With ``parallel.tensor_parallel_size > 1`` this process becomes rank 0: the worker
    processes start loading their shards first, then rank 0 loads its own.
    """
    r = resolve(source, registry or PluginRegistry(), **overrides)
    if r.pipeline.parallel.tensor_parallel_size == 1:
        return _build(r, None, replica)
    from modserve.core.distributed.tp_runner import start_workers

    workers = start_workers(r)
    try:
        return _build(r, workers, replica)
    except BaseException:
        workers.stop(grace_s=0)
        raise


def _decode_graphs(platform: Platform, shard: Shard, ctx: BuildContext) -> DecodeGraphs | None:
    """Graph replays of decode steps where the platform, model and attention backend allow them
    (single process: a tensor-parallel runner is built without)."""
    refusal = graph_refusal(platform, shard.model, shard.attention, tensor_parallel=False)
    if refusal is not None:
        if platform.graph_batch_sizes():
            log.info("decode graphs off: %s", refusal)
        return None
    return DecodeGraphs(platform, shard.model, shard.attention, shard.kv, ctx.device, ctx.max_model_len)


def _piecewise_graphs(platform: Platform, shard: Shard, ctx: BuildContext) -> PiecewiseGraphs | None:
    """Graph pieces for the other steps where the platform, model and attention backend allow them."""
    refusal = piece_refusal(platform, shard.model, shard.attention, tensor_parallel=False)
    if refusal is not None or shard.boundary is None:
        if platform.piece_token_sizes():
            log.info("graph pieces off: %s", refusal)
        return None
    return PiecewiseGraphs(platform, shard.model, shard.boundary, shard.kv, ctx.device)


def _build(r: ResolvedPipeline, workers, replica: int | None) -> EngineComponents:
    p = r.pipeline
    model_name = p.model.name or r.source.default_name
    shard = build_shard(r, 0, workers.tp if workers is not None else None, model_name, replica)
    ctx, kv = shard.ctx, shard.kv
    if workers is None:
        runner = ModelRunner(shard.model, kv, shard.attention, ctx.device, _decode_graphs(r.platform, shard, ctx),
                             _piecewise_graphs(r.platform, shard, ctx))
    else:
        from modserve.core.distributed.tp_runner import TPModelRunner

        workers.wait_ready(kv.num_blocks)
        runner = TPModelRunner(shard.model, kv, shard.attention, ctx.device, workers)
    scheduler = r.build("scheduler", ctx)
    sampler = r.build("sampler", ctx)
    processors = [r.build(key, ctx) for key in r.entries("logits_processors")]
    proposer = None
    if "speculative" in r.plugins:

        def load(path: str) -> LoadedModel:
            """A draft checkpoint beside the target, on its platform, dtype and context length."""
            return load_model(locate(path), make_attention, ctx)

        def make_attention(spec: ModelSpec):
            return r.build("attention", ctx.with_(model=spec, shards=1))  # a draft is not sharded

        target = TargetModel(shard.model, shard.tokenizer, load, make_attention)
        proposer = r.build("speculative", ctx.with_(target=target))
    tool_parser = r.build("tool_parser", ctx) if "tool_parser" in r.plugins else None
    reasoning_parser = r.build("reasoning_parser", ctx) if "reasoning_parser" in r.plugins else None
    observers = [r.build(key, ctx) for key in r.entries("observers")]
    names = {key: r.plugin_name(key) for key in ("device", *r.plugins)}
    return EngineComponents(
        pipeline=p,
        registry=r.registry,
        platform=r.platform,
        spec=ctx.model,
        tokenizer=shard.tokenizer,
        model_name=model_name,
        max_model_len=ctx.max_model_len,
        device=ctx.device,
        dtype=ctx.dtype,
        kv=kv,
        scheduler=scheduler,
        sampler=sampler,
        attention=shard.attention,
        runner=runner,
        proposer=proposer,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        logits_processors=processors,
        observers=observers,
        plugin_names=names,
    )
