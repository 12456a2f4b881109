"""tests/plugin_env.py: plugin packages install into a temporary folder, visible only where asked."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from plugin_env import install, install_plugins, on_sys_path, subprocess_env  # noqa: E402

MODULE, DIST, EP = "modserve_probe_plugin", "modserve-probe-plugin", "probe"

LIST_EPS = "from importlib.metadata import entry_points; print(sorted(ep.name for ep in entry_points(group='modserve')))"


def _probe_package(root: Path) -> Path:
    pkg = root / "probe-src"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{DIST}"
        version = "0.0.1"

        [project.entry-points.modserve]
        {EP} = "{MODULE}"

        [tool.setuptools]
        py-modules = ["{MODULE}"]
    """))
    (pkg / f"{MODULE}.py").write_text("MARK = 'probe'\n")
    return pkg


def _probe_entry_points() -> list[importlib.metadata.EntryPoint]:
    return [ep for ep in importlib.metadata.entry_points(group="modserve") if ep.value == MODULE]


def _nothing_installed_for_the_user() -> None:
    assert importlib.util.find_spec(MODULE) is None
    assert _probe_entry_points() == []
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution(DIST)
    for key in ("purelib", "platlib"):
        site = Path(sysconfig.get_paths()[key])
        assert not list(site.glob("modserve_probe_plugin*")), site


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    pkg = _probe_package(root)
    _nothing_installed_for_the_user()
    env = install_plugins([pkg], root / "target")
    assert sorted(p.name for p in pkg.iterdir()) == ["modserve_probe_plugin.py", "pyproject.toml"]  # built from a copy
    return env


def test_entry_point_visible_inside_the_block_and_gone_after(probe):
    before = list(sys.path)
    with probe.activate() as target:
        assert sys.path[0] == str(target)
        (ep,) = _probe_entry_points()
        assert ep.name == EP
        assert ep.load().MARK == "probe"
        spec = importlib.util.find_spec(MODULE)
        assert spec is not None and Path(spec.origin).is_relative_to(target)
        assert importlib.metadata.distribution(DIST).version == "0.0.1"
    assert sys.path == before
    assert MODULE not in sys.modules
    _nothing_installed_for_the_user()


def test_subprocess_env_carries_the_target(probe):
    seen = subprocess.run([sys.executable, "-c", LIST_EPS], env=probe.env(), capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    assert EP in seen.stdout
    plain = subprocess.run([sys.executable, "-c", LIST_EPS], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert f"'{EP}'" not in plain.stdout


def test_subprocess_env_keeps_an_existing_pythonpath(tmp_path):
    env = subprocess_env(tmp_path, {"PYTHONPATH": "/a", "X": "1"})
    assert env == {"PYTHONPATH": os.pathsep.join([str(tmp_path.resolve()), "/a"]), "X": "1"}
    assert subprocess_env(tmp_path, {})["PYTHONPATH"] == str(tmp_path.resolve())


def test_functional_api_and_a_failed_install(tmp_path):
    target = install([_probe_package(tmp_path)], tmp_path / "t")
    with on_sys_path(target):
        assert len(_probe_entry_points()) == 1
    assert _probe_entry_points() == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "pyproject.toml").write_text("[project\n")
    with pytest.raises(RuntimeError, match="pip install --target"):
        install([broken], tmp_path / "t2")
    with pytest.raises(ValueError, match="not a Python package folder"):
        install([tmp_path / "t"], tmp_path / "t3")
