"""The docs cannot drift from the code: the generated pipeline reference is current and
complete, every example pipeline validates, the tutorial's code runs, and the metrics,
HTTP and architecture pages match what they describe.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import msgspec
import pytest
import yaml

from modserve import cli
from modserve.core.config import PLUGIN_SECTIONS, PipelineConfig
from modserve.docs_gen import DEFAULT_OUTPUT, pipeline_reference
from modserve.core.engine import Engine
from modserve.core.engine_factory import build_components
from modserve.core.plugin_manager import PluginRegistry, default_registry
from modserve.core.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# ----------------------------------------------------------------------------- pipeline reference


def test_committed_pipeline_reference_is_current():
    fresh = pipeline_reference()
    assert DEFAULT_OUTPUT.read_text(encoding="utf-8") == fresh, (
        "docs/pipeline-reference.md is stale: run `python -m modserve.docs_gen`"
    )


def _tables(markdown: str) -> dict[str, set[str]]:
    """Heading -> the keys listed in the table under it."""
    tables: dict[str, set[str]] = {}
    heading = ""
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading = line
            tables[heading] = set()
        elif m := re.match(r"\| `(\w+)` \|", line):
            tables[heading].add(m.group(1))
    return tables


def _expected(struct: type, heading: str, path: str, nested_heading) -> list[tuple[str, type]]:
    """(heading, struct) for ``struct`` and every struct nested in it, as the page lays them out."""
    out = [(heading, struct)]
    for f in msgspec.structs.fields(struct):
        for t in (f.type, *getattr(f.type, "__args__", ())):
            if isinstance(t, type) and issubclass(t, msgspec.Struct):
                key = f"{path}.{f.name}" if path else f.name
                out += _expected(t, nested_heading(key), key, nested_heading)
    return out


def test_every_config_field_is_in_the_reference():
    """Every fixed section's fields and every registered plugin's options (installed ones too)."""
    registry = default_registry()
    tables = _tables(pipeline_reference(registry, builtin_only=False))
    expected = _expected(PipelineConfig, "## Top level", "", lambda key: f"## `{key}`")
    sections = [*PLUGIN_SECTIONS.items(), ("kv_cache.eviction", "eviction_policies")]
    for section, kind in sections:
        for name, impl in registry.implementations(kind).items():
            heading = f"### `{section}` plugin `{name}`"
            expected += _expected(impl.cls.Config, heading, section, lambda key, n=name: f"#### `{key}` (plugin `{n}`)")
    for heading, struct in expected:
        assert heading in tables, f"no section {heading!r} in the reference"
        missing = {f.name for f in msgspec.structs.fields(struct)} - tables[heading]
        assert not missing, f"{heading}: fields {sorted(missing)} missing from the reference"


def test_reference_shows_field_comments_and_defaults():
    reference = pipeline_reference()
    assert "| `name` | str \\| None | null | served model name; defaults to the path's last component |" in reference
    assert "| `block_n` | 16 \\| 32 \\| 64 \\| 128 | 64 | Keys per tile in both attention kernels. |" in reference
    assert "| `layers` | int >= 1 | required |" in reference


# ----------------------------------------------------------------------------- example pipelines


def _unregistered_plugins(path: Path) -> list[str]:
    """Plugins the pipeline names that no installed module registers (yet)."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    registry = default_registry()
    missing = []
    for section, kind in PLUGIN_SECTIONS.items():
        value = raw.get(section) or {}
        for entry in value if isinstance(value, list) else [value]:
            name = entry if isinstance(entry, str) else entry.get("plugin")
            if name not in (None, "auto") and name not in registry.implementations(kind):
                missing.append(f"{section} plugin {name!r}")
    eviction = (raw.get("kv_cache") or {}).get("eviction")
    if eviction is not None and eviction not in registry.implementations("eviction_policies"):
        missing.append(f"kv_cache.eviction policy {eviction!r}")
    return missing


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_pipeline_validates(path, capsys):
    missing = _unregistered_plugins(path)
    if missing:
        pytest.xfail(f"{path.name}: {', '.join(missing)} not registered yet")
    assert cli.main(["validate", "-c", str(path)]) == 0, capsys.readouterr().err
    assert f"{path}: ok" in capsys.readouterr().out


def test_examples_cover_the_main_compositions():
    names = {p.name for p in EXAMPLES}
    assert {"pipeline.yaml", "priority.yaml", "prefix-heavy.yaml", "speculative-ngram.yaml",
            "speculative-draft.yaml", "int8-kv.yaml", "triton.yaml"} <= names


# ----------------------------------------------------------------------------- tutorial


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.S)


def test_tutorial_plugins_run_a_pipeline(tiny_llama, capsys):
    """Every code block executes; together the plugins it defines serve the tiny model and,
    being output-preserving by design, give the same greedy tokens as the defaults."""
    registry = PluginRegistry()
    for i, code in enumerate(_python_blocks((DOCS / "plugins-tutorial.md").read_text(encoding="utf-8"))):
        module = types.ModuleType(f"tutorial_block_{i}")
        exec(compile(code, f"plugins-tutorial.md block {i}", "exec", dont_inherit=True), module.__dict__)
        if hasattr(module, "MODSERVE_CONTRACT"):
            registry.register_module(module)
    base = {  # plain torch on the cpu platform: what the tutorial's minimal platform runs
        "model": {"path": tiny_llama[0], "max_model_len": 128}, "kv_cache": {"plugin": "paged", "num_blocks": 64},
        "device": {"plugin": "cpu", "pack_weights": False, "fuse_ops": False}, "attention": {"plugin": "torch"},
    }
    tutorial = {
        **base,
        "device": "minimal_cpu",
        "attention": {"plugin": "auto"},  # the platform's default: torch
        "scheduler": {"plugin": "shortest_first", "max_num_seqs": 2},
        "kv_cache": {"plugin": "paged_watermark", "num_blocks": 64, "watermark": 0.05},
        "sampler": {"plugin": "soft_cap", "cap": 5.0},
        "logits_processors": [{"plugin": "logit_bias"}, {"plugin": "ban_tokens"}],
        "speculative": {"plugin": "repeat_last", "num_speculative_tokens": 2},
        "observers": [{"plugin": "metrics"}, {"plugin": "json_log"}],
        "tool_parser": "mistral_json",
    }
    prompts = [[10, 20, 30, 40, 50, 60], [70, 80], [90, 91, 92, 93]]
    want = _greedy(Engine(build_components(base)), prompts)
    engine = Engine(build_components(tutorial, registry=registry))
    assert engine.c.plugin_names["device"] == "minimal_cpu"
    parsed = engine.c.tool_parser.parse('Sure.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', True)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == ("Sure.", [("f", '{"x": 1}')])
    assert engine.c.tool_parser.parse("Sure.[TOOL_CA", False).content == "Sure."
    got = _greedy(engine, prompts)
    assert got == want
    assert capsys.readouterr().err.count('"finish_reason": "length"') == len(prompts)  # the observer's lines
    banned = _greedy(engine, prompts[:1], extra_args={"ban_tokens": [want[0][0]]})
    assert banned[0][0] != want[0][0]  # the processor really ran
    with pytest.raises(ValueError, match="extra_args.nope: not supported by this pipeline"):
        engine.add_request(prompts[0], SamplingParams(extra_args={"nope": 1}))
    engine.shutdown()


def _greedy(engine: Engine, prompts: list[list[int]], **params) -> list[list[int]]:
    sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0, **params)
    reqs = [engine.add_request(p, sp)[0] for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


# ----------------------------------------------------------------------------- other pages


def test_metrics_page_names_exactly_the_exported_metrics():
    from modserve.core.contract import NoOptions
    from modserve.core.plugin_manager import standalone_context
    from modserve.plugins.observers.metrics import MetricsObserver

    exported = {
        c.name + ("_total" if c.type == "counter" else "")
        for c in MetricsObserver(NoOptions(), standalone_context(max_model_len=2048)).registry.collect()
    }
    documented = set(re.findall(r"`(modserve:\w+)`", (DOCS / "metrics.md").read_text(encoding="utf-8")))
    assert documented == exported


def test_http_api_page_lists_every_route():
    from modserve.server.routes import ROUTES

    page = (DOCS / "http-api.md").read_text(encoding="utf-8")
    for route in ROUTES:
        path = re.sub(r":\w+}", "}", route.path)  # {model_id:path} is written {model_id}
        for method in sorted(route.methods - {"HEAD"}):
            assert f"`{method} {path}`" in page


def test_architecture_file_map_covers_the_core():
    page = (DOCS / "architecture.md").read_text(encoding="utf-8")
    for path in sorted((ROOT / "core").glob("*.py")):
        if path.name != "__init__.py":
            assert f"`core/{path.name}`" in page, f"core/{path.name} missing from docs/architecture.md"
    for mentioned in re.findall(r"`((?:core|plugins|examples)/[\w/.-]*)`", page):
        assert (ROOT / mentioned).exists(), f"docs/architecture.md names {mentioned}, which does not exist"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")) + sorted(ROOT.glob("examples/plugins/*/README.md")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", page.read_text(encoding="utf-8")):
        file, anchor = target
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name} links to missing {file}"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name} links to missing anchor {file}#{anchor}"


def test_pyproject_lists_every_package_folder():
    """A folder with an ``__init__.py`` that pyproject does not list would be missing from a
    regular (non-editable) install, though an editable one finds it."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" in relative or "build" in relative:
                continue
            name = ".".join((package, *relative))
            assert name in listed, f"pyproject.toml [tool.setuptools] packages lacks {name!r}"
