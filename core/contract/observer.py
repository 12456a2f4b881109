"""Observers: metrics, tracing and third-party loggers, called per request or per step.

An observer class implements any of the ``on_*`` hooks of
:class:`~modserve.core.contract.hookspecs.ModserveSpec` as methods marked ``@hookimpl``; the
engine registers each observer named in the pipeline's ``observers`` list on its own
plugin manager. A failing observer is logged and never stops the engine.
"""

from __future__ import annotations

from modserve.core.contract.plugin import Plugin


class Observer(Plugin):
    """Built last, with the whole context set (``ctx.model_name``, ``ctx.max_model_len``,
    ``ctx.replica``); implements ``on_*`` hooks with ``@hookimpl``."""

    def close(self) -> None:  # noqa: B027 - optional
        """The engine stopped: flush and release (exporters, files)."""
