"""The plugin contract in one place: hook specs, the interface of every kind, the build context.

A plugin author imports from here only::

    from modserve.core.contract import hookimpl, KVBackend, BuildContext

Kinds (registration hook -> interface): ``register_platforms`` -> :class:`Platform`,
``register_models`` -> :class:`ModelArchitecture`, ``register_schedulers`` -> :class:`Scheduler`,
``register_kv_backends`` -> :class:`KVBackend`, ``register_eviction_policies`` ->
:class:`EvictionPolicy`, ``register_attention_backends`` -> :class:`AttentionBackend`,
``register_samplers`` -> :class:`Sampler`, ``register_logits_processors`` ->
:class:`LogitsProcessor`, ``register_speculative_decoders`` -> :class:`Proposer`, ``register_tool_parsers`` ->
:class:`ToolParser`, ``register_reasoning_parsers`` -> :class:`ReasoningParser`,
``register_observers`` -> :class:`Observer`. Every class is built as ``cls(config, ctx)``.
"""

from modserve.core.contract.attention import AttentionBackend, AttentionMetadata, AttentionSpec
from modserve.core.contract.build_context import BuildContext
from modserve.core.contract.hookspecs import CONTRACT_VERSION, ENTRY_POINT_GROUP, MIGRATION_NOTES, hookimpl, hookspec
from modserve.core.contract.kv import (
    BlockCopy,
    EvictionPolicy,
    KVBackend,
    KVSpec,
    KVStats,
    LayerKVCache,
    PrefixHit,
    copy_layer_blocks,
)
from modserve.core.contract.logits import LogitsProcessor, LogitsRow
from modserve.core.contract.model import ModelArchitecture
from modserve.core.contract.model_spec import ModelSpec
from modserve.core.contract.observer import Observer
from modserve.core.contract.platform import DeviceInfo, GatedLinear, PieceRecorder, Platform
from modserve.core.contract.plugin import NoOptions, Plugin
from modserve.core.contract.reasoning_parser import ReasoningParser
from modserve.core.contract.sampler import Sampler, SamplerOutput
from modserve.core.contract.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, SchedulerStats
from modserve.core.contract.speculative import Proposer, SpeculativeConfig, TargetModel
from modserve.core.contract.stats import StepStats
from modserve.core.contract.tool_parser import ToolCall, ToolParse, ToolParser

# the registration hook of kind K is register_K
KINDS: dict[str, type] = {  # kind -> interface
    "platforms": Platform,
    "models": ModelArchitecture,
    "schedulers": Scheduler,
    "kv_backends": KVBackend,
    "eviction_policies": EvictionPolicy,
    "attention_backends": AttentionBackend,
    "samplers": Sampler,
    "logits_processors": LogitsProcessor,
    "speculative_decoders": Proposer,
    "tool_parsers": ToolParser,
    "reasoning_parsers": ReasoningParser,
    "observers": Observer,
}

__all__ = [
    "CONTRACT_VERSION", "ENTRY_POINT_GROUP", "KINDS", "MIGRATION_NOTES",
    "AttentionBackend", "AttentionMetadata", "AttentionSpec", "BlockCopy", "BuildContext", "CausalLM",
    "DeviceInfo", "EvictionPolicy", "ExpertMLP", "GatedLinear", "KVBackend", "KVSpec", "KVStats", "LayerKVCache", "LogitsProcessor",
    "LogitsRow", "ModelArchitecture", "ModelSpec", "NativeFunction", "NoOptions", "Observer", "PieceRecorder", "Platform", "Plugin",
    "PrefixHit", "Proposer", "ReasoningParser", "Sampler", "SamplerOutput", "ScheduledRequest", "Scheduler", "SchedulerOutput",
    "SchedulerStats", "SpeculativeConfig", "StepStats", "TargetModel", "ToolCall", "ToolParse", "ToolParser", "copy_layer_blocks", "hookimpl", "hookspec",
]


def __getattr__(name: str):
    if name == "CausalLM":  # imports torch: only when asked for
        from modserve.core.contract.causal_lm import CausalLM

        return CausalLM
    if name == "ExpertMLP":  # imports torch (contract 2.8)
        from modserve.core.contract.experts import ExpertMLP

        return ExpertMLP
    if name == "NativeFunction":  # a kernel a CPU decode graph can record (contract 2.6)
        from modserve.core.native_calls import NativeFunction

        return NativeFunction
    raise AttributeError(f"module 'modserve.core.contract' has no attribute {name!r}")
