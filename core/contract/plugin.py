"""What every plugin class is: a ``Config`` struct for its YAML options and ``cls(config, ctx)``.

Every kind's interface derives from :class:`Plugin`, so the core builds each kind the same
way and never asks a plugin for anything its interface does not declare.
"""

from __future__ import annotations

from abc import ABC
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

if TYPE_CHECKING:
    from modserve.core.contract.build_context import BuildContext


class NoOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Config for an implementation that takes no options."""


class Plugin(ABC):
    """Base of every kind. ``Config`` validates the pipeline section's options; the instance
    is built as ``cls(config, ctx)`` with the :class:`BuildContext` of the engine being built."""

    Config: ClassVar[type[msgspec.Struct]] = NoOptions

    def __init__(self, config: Any, ctx: BuildContext) -> None:
        self.config = config

    @classmethod
    def check_config(cls, config: Any, registry: Any) -> None:
        """Cross-checks at validation time that need other plugins (``registry`` is the
        :class:`~modserve.core.plugin_manager.PluginRegistry`), e.g. that a named eviction policy
        exists. Raise :class:`~modserve.core.config.ConfigError` naming the field. Default: none."""
