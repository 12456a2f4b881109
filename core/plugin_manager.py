"""Discovers plugins (built-in modules and the ``modserve`` entry-point group) and resolves
pipeline sections to implementation classes with validated configs.

Built-in and out-of-tree plugins are registered the same way: a module with
``@hookimpl`` functions and a ``MODSERVE_CONTRACT`` string.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any

import msgspec
import pluggy

from modserve.core import hookspecs
from modserve.core.config import PLUGIN_SECTIONS, ConfigError, convert

BUILTIN_PLUGIN_MODULES = (
    "modserve.plugins.schedulers.fcfs",
    "modserve.plugins.schedulers.priority",
    "modserve.plugins.schedulers.static",
    "modserve.plugins.kv_backends.paged",
    "modserve.plugins.kv_backends.lru",
    "modserve.plugins.kv_backends.contiguous",
    "modserve.plugins.attention.torch_backend",
    "modserve.plugins.attention.cpu_backend",
    "modserve.plugins.attention.triton_backend",
    "modserve.plugins.samplers.default",
    "modserve.plugins.speculative.ngram",
    "modserve.plugins.speculative.draft_model",
)

KINDS = (*PLUGIN_SECTIONS.values(), "eviction_policies")


class PluginContractError(RuntimeError):
    """A plugin written for a contract version this core does not provide."""


@dataclass(frozen=True)
class Implementation:
    kind: str
    name: str
    cls: type
    source: str  # distribution or module that registered it
    contract: str


def check_contract(module: ModuleType, source: str) -> str:
    """Refuse a plugin whose ``MODSERVE_CONTRACT`` is another major or a newer minor version."""
    declared = getattr(module, "MODSERVE_CONTRACT", None)
    if declared is None:
        raise PluginContractError(
            f"plugin {source} does not declare MODSERVE_CONTRACT; this modserve provides "
            f"contract {hookspecs.CONTRACT_VERSION}"
        )
    try:
        major, minor = (int(x) for x in str(declared).split("."))
    except ValueError:
        raise PluginContractError(f"plugin {source}: MODSERVE_CONTRACT must look like '1.0', got {declared!r}") from None
    core_major, core_minor = (int(x) for x in hookspecs.CONTRACT_VERSION.split("."))
    if major != core_major or minor > core_minor:
        raise PluginContractError(
            f"plugin {source} targets modserve contract {declared}, but this modserve provides "
            f"contract {hookspecs.CONTRACT_VERSION}; upgrade or downgrade one of them"
        )
    return str(declared)


class PluginRegistry:
    """All registered implementations, by kind and name, plus the pluggy manager for observers."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs.ModserveSpec)
        self._sources: dict[str, tuple[str, str]] = {}  # plugin name in pm -> (source, contract)
        for name in BUILTIN_PLUGIN_MODULES:
            self.register_module(importlib.import_module(name), source="modserve (built-in)")
        for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            source = f"{ep.dist.name if ep.dist else ep.value} ({ep.value})"
            self.register_module(ep.load(), source=source)

    def register_module(self, module: Any, source: str | None = None) -> None:
        source = source or getattr(module, "__name__", repr(module))
        contract = check_contract(module, source)
        name = self.pm.register(module)
        self._sources[name] = (source, contract)

    def implementations(self, kind: str) -> dict[str, Implementation]:
        found: dict[str, Implementation] = {}
        hook = getattr(self.pm.hook, f"register_{kind}")
        for impl in hook.get_hookimpls():
            source, contract = self._sources.get(self.pm.get_name(impl.plugin), ("?", "?"))
            for name, cls in (impl.function() or {}).items():
                found.setdefault(name, Implementation(kind, name, cls, source, contract))
        return found

    def resolve(self, section: str, raw: dict[str, Any] | None) -> tuple[type, msgspec.Struct]:
        """Pick the implementation named by ``raw['plugin']`` and validate its options."""
        kind = PLUGIN_SECTIONS[section]
        if not isinstance(raw, dict):
            raise ConfigError(f"{section}: expected a mapping with a 'plugin' key, got {raw!r}")
        options = dict(raw)
        name = options.pop("plugin", None)
        available = self.implementations(kind)
        if not isinstance(name, str):
            raise ConfigError(f"{section}.plugin: required; available: {', '.join(sorted(available))}")
        if name not in available:
            raise ConfigError(
                f"{section}.plugin: unknown {kind[:-1].replace('_', ' ')} {name!r}; "
                f"available: {', '.join(sorted(available))}"
            )
        cls = available[name].cls
        config = convert(options, cls.Config, prefix=section)
        check = getattr(cls, "check_config", None)  # cross-checks that need the registry
        if check is not None:
            check(config, self)
        return cls, config


@lru_cache(maxsize=1)
def default_registry() -> PluginRegistry:
    return PluginRegistry()


def config_fields(cls: type) -> list[tuple[str, str, Any]]:
    """(name, type, default) of an implementation's Config, for ``modserve plugins`` and docs."""
    out = []
    for f in msgspec.structs.fields(cls.Config):
        default = f.default if f.default is not msgspec.NODEFAULT else (
            f.default_factory() if f.default_factory is not msgspec.NODEFAULT else "(required)"
        )
        out.append((f.name, type_name(f.type), default))
    return out


def type_name(tp: Any) -> str:
    """Readable type of a config field: ``int >= 1``, ``float | None``, ``'auto' | 'int8'``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        meta = next((a for a in args[1:] if isinstance(a, msgspec.Meta)), None)
        bounds = []
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if meta is not None and getattr(meta, attr) is not None:
                bounds.append(f"{op} {getattr(meta, attr)}")
        return " ".join([type_name(args[0]), *bounds])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))
