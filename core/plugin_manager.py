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

from modserve.core.contract import CONTRACT_VERSION, ENTRY_POINT_GROUP, KINDS, MIGRATION_NOTES, hookspecs
from modserve.core.config import NESTED_PLUGIN_KEYS, PLUGIN_SECTIONS, ConfigError, convert

BUILTIN_PLUGIN_MODULES = (  # registered by module name, as pytest registers its own plugins
    "modserve.plugins.platforms.cuda",
    "modserve.plugins.platforms.cpu",
    "modserve.plugins.models.llama",
    "modserve.plugins.models.qwen3",
    "modserve.plugins.models.mixtral",
    "modserve.plugins.models.olmo2",
    "modserve.plugins.models.phi3",
    "modserve.plugins.models.gemma",
    "modserve.plugins.models.granite",
    "modserve.plugins.schedulers.fcfs",
    "modserve.plugins.schedulers.priority",
    "modserve.plugins.schedulers.static",
    "modserve.plugins.kv_backends.paged",
    "modserve.plugins.kv_backends.contiguous",
    "modserve.plugins.eviction.lru",
    "modserve.plugins.attention.torch_backend",
    "modserve.plugins.attention.cpu_backend",
    "modserve.plugins.attention.triton_backend",
    "modserve.plugins.samplers.default",
    "modserve.plugins.logits_processors.logit_bias",
    "modserve.plugins.logits_processors.structured_outputs",
    "modserve.plugins.logits_processors.token_filters",
    "modserve.plugins.tool_parsers.hermes",
    "modserve.plugins.tool_parsers.llama3_json",
    "modserve.plugins.reasoning_parsers.think",
    "modserve.plugins.speculative.ngram",
    "modserve.plugins.speculative.draft_model",
    "modserve.plugins.observers.metrics",
    "modserve.plugins.observers.tracing",
)

BUILTIN = "modserve (built-in)"


class PluginContractError(RuntimeError):
    """A plugin written for a contract version this core does not provide, or that breaks it."""


@dataclass(frozen=True)
class Implementation:
    kind: str
    name: str
    cls: type
    source: str  # distribution or module that registered it
    contract: str

    @property
    def builtin(self) -> bool:
        return self.source == BUILTIN


def check_contract(module: ModuleType, source: str) -> str:
    """Refuse a plugin whose ``MODSERVE_CONTRACT`` is another major or a newer minor version."""
    declared = vars(module).get("MODSERVE_CONTRACT") if isinstance(module, ModuleType) else type(module).__dict__.get("MODSERVE_CONTRACT")
    if declared is None:
        raise PluginContractError(
            f"plugin {source} does not declare MODSERVE_CONTRACT; this modserve provides "
            f"contract {CONTRACT_VERSION}"
        )
    try:
        major, minor = (int(x) for x in str(declared).split("."))
    except ValueError:
        raise PluginContractError(f"plugin {source}: MODSERVE_CONTRACT must look like '2.0', got {declared!r}") from None
    core_major, core_minor = (int(x) for x in CONTRACT_VERSION.split("."))
    if major == 1 and core_major == 2:
        raise PluginContractError(
            f"plugin {source} targets modserve contract {declared}, but this modserve provides contract "
            f"{CONTRACT_VERSION}: every plugin class is now built as cls(config, ctx) with a typed BuildContext, "
            "derives from its kind's interface in modserve.core.contract, and declares what the core reads "
            f"(stats(), copy_blocks); see {MIGRATION_NOTES}"
        )
    if major != core_major or minor > core_minor:
        raise PluginContractError(
            f"plugin {source} targets modserve contract {declared}, but this modserve provides "
            f"contract {CONTRACT_VERSION}; upgrade or downgrade one of them"
        )
    return str(declared)


class PluginRegistry:
    """All registered implementations, by kind and name, plus the pluggy manager for observers."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs.ModserveSpec)
        self._sources: dict[str, tuple[str, str]] = {}  # plugin name in pm -> (source, contract)
        self._order: list[str] = []  # pm names in registration order
        for name in BUILTIN_PLUGIN_MODULES:
            self.register_module(importlib.import_module(name), source=BUILTIN)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            source = f"{ep.dist.name if ep.dist else ep.value} ({ep.value})"
            self.register_module(ep.load(), source=source)
        self._cache: dict[str, dict[str, Implementation]] = {}
        for kind in KINDS:  # duplicates and interface violations are start-up errors
            self.implementations(kind)

    def register_module(self, module: Any, source: str | None = None) -> None:
        source = source or (module.__name__ if isinstance(module, ModuleType) else repr(module))
        contract = check_contract(module, source)
        name = self.pm.register(module)
        self._sources[name] = (source, contract)
        self._order.append(name)
        self._cache = {}

    def implementations(self, kind: str) -> dict[str, Implementation]:
        """``{name: Implementation}`` of ``kind`` in registration order (built-ins first)."""
        if kind in self._cache:
            return self._cache[kind]
        found: dict[str, Implementation] = {}
        hook = getattr(self.pm.hook, f"register_{kind}")  # pluggy's hook relay, not a plugin
        impls = sorted(hook.get_hookimpls(), key=lambda i: self._order.index(self.pm.get_name(i.plugin)))
        interface = KINDS[kind]
        for impl in impls:
            source, contract = self._sources.get(self.pm.get_name(impl.plugin), ("?", "?"))
            for name, cls in (impl.function() or {}).items():
                if name in found:
                    raise PluginContractError(
                        f"{kind[:-1].replace('_', ' ')} {name!r} is registered twice: by {found[name].source} "
                        f"and by {source}; uninstall one of them"
                    )
                if not (isinstance(cls, type) and issubclass(cls, interface)):
                    raise PluginContractError(
                        f"plugin {source}: register_{kind} returned {name!r} -> {cls!r}, which does not derive "
                        f"from modserve.core.contract.{interface.__name__}"
                    )
                found[name] = Implementation(kind, name, cls, source, contract)
        self._cache[kind] = found
        return found

    def resolve(self, section: str, raw: Any) -> tuple[type, msgspec.Struct]:
        """Pick the implementation named by ``raw['plugin']`` (or ``raw`` itself when it is a bare
        name) for the pipeline key ``section`` and validate its options."""
        kind = section_kind(section)
        options = {"plugin": raw} if isinstance(raw, str) else raw
        if not isinstance(options, dict):
            raise ConfigError(f"{section}: expected a mapping with a 'plugin' key, got {raw!r}")
        options = dict(options)
        name = options.pop("plugin", None)
        available = self.implementations(kind)
        where = section if isinstance(raw, str) else f"{section}.plugin"
        if not isinstance(name, str):
            raise ConfigError(f"{where}: required; available: {', '.join(available)}")
        if name not in available:
            raise ConfigError(
                f"{where}: unknown {kind[:-1].replace('_', ' ')} {name!r}; "
                f"available: {', '.join(available)}"
            )
        cls = available[name].cls
        config = convert(options, cls.Config, prefix=section)
        cls.check_config(config, self)
        return cls, config

    def create(self, section: str, raw: Any, ctx: Any) -> Any:
        """Resolve ``raw`` for the pipeline key ``section`` and build it as ``cls(config, ctx)``."""
        cls, config = self.resolve(section, raw)
        return cls(config, ctx)

    def available_platform(self) -> str:
        """``device: auto``: the first platform that says it is available, out-of-tree ones first."""
        platforms = self.implementations("platforms")
        ordered = [i for i in platforms.values() if not i.builtin] + [i for i in platforms.values() if i.builtin]
        for impl in ordered:
            if impl.cls.is_available():
                return impl.name
        raise ConfigError(f"device: auto found no available platform among {', '.join(platforms)}")


def section_kind(section: str) -> str:
    """The plugin kind behind a pipeline key: ``kv_cache`` -> ``kv_backends``, ``observers[1]`` ->
    ``observers``, ``kv_cache.eviction`` -> ``eviction_policies``."""
    return NESTED_PLUGIN_KEYS.get(section) or PLUGIN_SECTIONS[section.split("[")[0]]


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


def standalone_context(
    model: Any = None, kv_spec: Any = None, kv: Any = None, *, attention: Any = None, device: str = "cpu",
    registry: PluginRegistry | None = None, max_model_len: int | None = None, dtype: Any = None,
) -> Any:
    """A :class:`~modserve.core.contract.BuildContext` for building one plugin outside an engine
    (unit tests, benchmarks, a plugin author's own tests): ``device`` names the platform;
    ``dtype`` and ``max_model_len`` default to ``kv_spec``'s; ``attention`` gives an attention
    backend its shape directly."""
    from modserve.core.contract import BuildContext

    registry = registry or default_registry()
    base = BuildContext(registry, max_model_len)
    platform = registry.create("device", device, base)
    if kv_spec is not None:
        dtype = dtype or kv_spec.dtype
        max_model_len = max_model_len or kv_spec.max_model_len
    return base.with_(
        platform=platform, device=platform.device(), dtype=dtype, model=model, kv_spec=kv_spec, kv=kv,
        max_model_len=max_model_len, attention=attention,
    )
