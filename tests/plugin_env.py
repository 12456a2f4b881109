"""Install local plugin packages into a throwaway folder, never the user's environment.

``pip install --target`` puts each package (non-editable, with its ``.dist-info`` and so its
entry points) into a folder of the test's own; nothing is written to the running
interpreter's site-packages, pip's cache or the package's source tree (it is built from a
copy). The folder is then made visible only where a test asks:

- in this process, for the ``with`` block of :func:`on_sys_path` (or :meth:`PluginEnv.activate`):
  the folder goes first on ``sys.path``, so ``importlib.metadata.entry_points(group="modserve")``
  finds the packages; on exit it is removed and what was imported from it is forgotten;
- in a subprocess, through the environment :func:`subprocess_env` (or :meth:`PluginEnv.env`)
  returns: ``PYTHONPATH`` with the folder first, so ``modserve plugins`` run as a child sees them.

Typical use, in a session fixture::

    env = install_plugins(sorted(EXAMPLES.iterdir()), tmp_path_factory.mktemp("plugins"))
    with env.activate():
        ...  # default_registry() now includes the packages' plugins
    subprocess.run([sys.executable, "-m", "modserve.cli", "plugins"], env=env.env())
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PluginEnv", "install", "install_plugins", "on_sys_path", "subprocess_env"]

# what an in-tree build leaves in a package folder: not copied into the staging copy
_BUILD_LEFTOVERS = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


def install(package_dirs: Iterable[str | os.PathLike], target: str | os.PathLike | None = None) -> Path:
    """``pip install --no-deps --no-build-isolation --target TARGET`` the local packages in
    ``package_dirs`` (folders with a ``pyproject.toml``); returns ``TARGET``.

    ``target`` defaults to a new temporary folder (the caller removes it; a pytest
    ``tmp_path`` is removed by pytest). Each package is built from a copy, so its own folder
    gets no ``build/`` or ``*.egg-info``. Raises ``RuntimeError`` with pip's output on failure.
    """
    dirs = [Path(d).resolve() for d in package_dirs]
    if not dirs:
        raise ValueError("install: no package folders given")
    for d in dirs:
        if not (d / "pyproject.toml").is_file() and not (d / "setup.py").is_file():
            raise ValueError(f"install: {d} is not a Python package folder (no pyproject.toml or setup.py)")
    target = Path(target) if target is not None else Path(tempfile.mkdtemp(prefix="modserve-plugins-"))
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="modserve-plugin-src-") as staging:
        copies = []
        for i, d in enumerate(dirs):
            copy = Path(staging) / f"{i}-{d.name}"
            shutil.copytree(d, copy, ignore=_BUILD_LEFTOVERS)
            copies.append(str(copy))
        cmd = [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
            "--no-cache-dir", "--disable-pip-version-check", "--no-warn-script-location",
            "--target", str(target), *copies,
        ]
        env = {**os.environ, "PIP_USER": "0", "PIP_REQUIRE_VIRTUALENV": "0"}
        env.pop("PIP_TARGET", None)
        env.pop("PIP_PREFIX", None)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"pip install --target {target} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return target


@contextmanager
def on_sys_path(target: str | os.PathLike) -> Iterator[Path]:
    """Put ``target`` first on ``sys.path`` for the ``with`` block (entry points and imports
    find what :func:`install` put there), then take it away again: the path entry, the
    modules imported from it, and the import and metadata caches that remember it.

    The registry modserve builds from entry points (``default_registry``) is rebuilt on
    entry and on exit, so it sees the packages exactly while the block runs."""
    target = Path(target).resolve()
    entry = str(target)
    sys.path.insert(0, entry)
    _refresh()
    try:
        yield target
    finally:
        while entry in sys.path:
            sys.path.remove(entry)
        for name, module in list(sys.modules.items()):
            if _loaded_from(module, target):
                del sys.modules[name]
        sys.path_importer_cache.pop(entry, None)
        _refresh()


def subprocess_env(target: str | os.PathLike, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) with ``target`` first on ``PYTHONPATH``, for
    ``subprocess.run(..., env=...)``: the child finds the installed packages and their entry points."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(target).resolve()), *([rest] if rest else [])])
    return env


@dataclass(frozen=True)
class PluginEnv:
    """Packages installed into ``target`` by :func:`install_plugins`."""

    target: Path

    def activate(self):
        """Context manager: the packages visible in this process for the block (:func:`on_sys_path`)."""
        return on_sys_path(self.target)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a subprocess that should see the packages (:func:`subprocess_env`)."""
        return subprocess_env(self.target, base)


def install_plugins(package_dirs: Iterable[str | os.PathLike], target: str | os.PathLike | None = None) -> PluginEnv:
    """:func:`install` the packages into ``target`` and return them as a :class:`PluginEnv`."""
    return PluginEnv(install(package_dirs, target))


def _loaded_from(module: object, target: Path) -> bool:
    """Whether ``module`` (or, for a namespace package, one of its folders) lies under ``target``."""
    paths = [getattr(module, "__file__", None)]
    try:  # some modules (torch.classes) answer any attribute with an object of their own
        if getattr(module, "__file__", None) is None:
            paths.extend(list(getattr(module.__spec__, "submodule_search_locations", None) or []))
    except Exception:
        pass
    for path in paths:
        if isinstance(path, str) and os.path.isabs(path):
            if Path(path).resolve().is_relative_to(target):
                return True
    return False


def _refresh() -> None:
    importlib.invalidate_caches()  # FileFinder listings and importlib.metadata's path cache
    try:
        from modserve.core.plugin_manager import default_registry
    except ImportError:
        return
    cache_clear = getattr(default_registry, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
