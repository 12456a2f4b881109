"""The plugin contract: every pluggy hook spec modserve calls, with its docstring as the spec.

There are two families of hooks:

* Registration hooks (``register_*``) are called once at start-up. Each returns a
  mapping ``{name: implementation class}``. The class declares its typed options as a
  nested ``Config`` (a ``msgspec.Struct``) and follows the matching interface in
  :mod:`modserve.core.interfaces`. The engine then calls the chosen objects directly:
  no hook is dispatched per layer or per token.
* Observer hooks (``on_*``) are called per request or per step, never per token. Metrics,
  tracing and third-party loggers implement them.

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
    from modserve.core.stats import StepStats

PROJECT = "modserve"
ENTRY_POINT_GROUP = "modserve"
CONTRACT_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class ModserveSpec:
    """Hook specifications. Implement any subset with ``@hookimpl`` in a plugin module."""

    # ----- registration: called once at start-up ------------------------------------

    @hookspec
    def register_schedulers(self) -> dict[str, type]:
        """Return ``{name: cls}`` for classes implementing :class:`~modserve.core.interfaces.Scheduler`."""

    @hookspec
    def register_kv_backends(self) -> dict[str, type]:
        """Return ``{name: cls}`` for classes implementing :class:`~modserve.core.interfaces.KVBackend`."""

    @hookspec
    def register_attention_backends(self) -> dict[str, type]:
        """Return ``{name: cls}`` for classes implementing :class:`~modserve.core.interfaces.AttentionBackend`."""

    @hookspec
    def register_samplers(self) -> dict[str, type]:
        """Return ``{name: cls}`` for classes implementing :class:`~modserve.core.interfaces.Sampler`."""

    @hookspec
    def register_speculative_decoders(self) -> dict[str, type]:
        """Return ``{name: cls}`` for classes implementing :class:`~modserve.core.interfaces.Proposer`."""

    @hookspec
    def register_eviction_policies(self) -> dict[str, type]:
        """Return ``{name: cls}`` for classes implementing :class:`~modserve.core.interfaces.EvictionPolicy`
        (chosen by the ``paged`` KV backend's ``eviction`` option)."""

    # ----- observers: called per request or per step, never per token -------------------

    @hookspec
    def on_engine_started(self, engine_info: dict[str, Any]) -> None:
        """Called once when an engine is built. ``engine_info`` holds ``model_name``,
        ``num_blocks``, ``block_size`` and the chosen plugin names."""

    @hookspec
    def on_request_added(self, request: Request) -> None:
        """Called when a request enters the engine's waiting queue."""

    @hookspec
    def on_request_finished(self, request: Request) -> None:
        """Called once when a request leaves the engine for any reason.

        ``request.finish_reason`` is ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``;
        ``request.metrics`` carries its timestamps (arrival, scheduled, first token, finish).
        """

    @hookspec
    def on_step_finished(self, stats: StepStats) -> None:
        """Called after every engine step with that step's counts and timings."""
