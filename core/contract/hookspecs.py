"""The plugin contract: every pluggy hook spec modserve calls, with its docstring as the spec.

There are two families of hooks:

* Registration hooks (``register_*``) are called once at start-up. Each returns a
  mapping ``{name: implementation class}``. The class declares its typed options as a
  nested ``Config`` (a ``msgspec.Struct``) and follows the matching interface in
  :mod:`modserve.core.contract` (every kind derives from ``Plugin``) and is built as
  ``cls(config, ctx)``. The engine then calls the chosen objects directly: no hook is
  dispatched per layer or per token. Two packages registering one name for one kind is a
  start-up error naming both.
* Observer hooks (``on_*``) are called per request or per step, never per token. Observer
  plugins (metrics, tracing, third-party loggers) implement them as ``@hookimpl`` methods.

A plugin module states the contract it was written for with a module-level
``MODSERVE_CONTRACT = "<major>.<minor>"``. A different major version, or a newer minor
version than this core provides, is refused at start-up (see
:func:`modserve.core.plugin_manager.check_contract`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from modserve.core.request import Request
    from modserve.core.contract.stats import StepStats

PROJECT = "modserve"
ENTRY_POINT_GROUP = "modserve"
CONTRACT_VERSION = "2.8"  # 2.1: tool parsers and reasoning parsers; 2.2: AttentionBackend.for_layer; 2.3: GatedLinear, DeviceInfo.kernels; 2.4: AttentionMetadata.request_lens; 2.5: decode graphs (Platform.graph_batch_sizes, capture_graph; capturable attention and models); 2.6: CPU decode graphs as call lists of NativeFunction kernels; 2.7: graph pieces between attention calls (Platform.piece_token_sizes, piece_recorder); 2.8: Platform.experts, ExpertMLP (a platform computes mixtures of experts its own way)
MIGRATION_NOTES = "docs/plugins-tutorial.md#migrating-from-contract-1x"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class ModserveSpec:
    """Hook specifications. Implement any subset with ``@hookimpl`` in a plugin module."""

    # ----- registration: called once at start-up; each returns {name: class} ------------

    @hookspec
    def register_platforms(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.platform.Platform` classes (``device:`` in the pipeline)."""

    @hookspec
    def register_models(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.model.ModelArchitecture` classes, chosen by a checkpoint's ``model_type``."""

    @hookspec
    def register_schedulers(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.scheduler.Scheduler` classes (``scheduler:``)."""

    @hookspec
    def register_kv_backends(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.kv.KVBackend` classes (``kv_cache:``)."""

    @hookspec
    def register_eviction_policies(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.kv.EvictionPolicy` classes (the ``paged`` backend's ``eviction``)."""

    @hookspec
    def register_attention_backends(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.attention.AttentionBackend` classes (``attention:``)."""

    @hookspec
    def register_samplers(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.sampler.Sampler` classes (``sampler:``)."""

    @hookspec
    def register_logits_processors(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.logits.LogitsProcessor` classes (``logits_processors:``)."""

    @hookspec
    def register_speculative_decoders(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.speculative.Proposer` classes (``speculative:``)."""

    @hookspec
    def register_tool_parsers(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.tool_parser.ToolParser` classes (``tool_parser:``)."""

    @hookspec
    def register_reasoning_parsers(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.reasoning_parser.ReasoningParser` classes (``reasoning_parser:``)."""

    @hookspec
    def register_observers(self) -> dict[str, type]:
        """:class:`~modserve.core.contract.observer.Observer` classes (``observers:``)."""

    # ----- observers: called per request or per step, never per token -------------------

    @hookspec
    def on_engine_started(self, engine_info: dict[str, Any]) -> None:
        """Called once when an engine is built. ``engine_info`` holds ``model_name``,
        ``num_blocks``, ``block_size``, ``platform`` and the chosen plugin names."""

    @hookspec
    def on_request_received(self, request_id: str, headers: dict[str, str], operation: str, response_id: str) -> None:
        """The server accepted an HTTP request that becomes engine request ``request_id`` (its
        ``n`` sequences carry it as ``Request.parent_id``); ``headers`` are its lower-cased HTTP
        headers (W3C trace context), ``operation`` the API operation (``text_completion``,
        ``chat``). Called before the request is added."""

    @hookspec
    def on_request_added(self, request: Request) -> None:
        """Called when a request enters the engine's waiting queue."""

    @hookspec
    def on_request_rejected(self, reason: str) -> None:
        """The server refused a request at admission (503): ``reason`` is ``overloaded``,
        ``shutting_down`` or ``engine_dead``."""

    @hookspec
    def on_request_finished(self, request: Request) -> None:
        """Called once when a request leaves the engine for any reason.

        ``request.finish_reason`` is ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``;
        ``request.metrics`` carries its timestamps (arrival, scheduled, first token, finish).
        """

    @hookspec
    def on_step_finished(self, stats: StepStats) -> None:
        """Called after every engine step with that step's counts and timings."""

    @hookspec
    def prometheus_collectors(self) -> list[Any]:
        """``prometheus_client`` collectors this observer exports on ``GET /metrics`` (called
        per scrape, not per step). The server merges every observer's and every replica's."""
