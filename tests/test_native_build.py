"""``python -m modserve.native.build`` (what ``scripts/setup.sh`` runs): every kernel source
compiled for this machine into the cache, one failure reported by name without stopping the rest."""

from __future__ import annotations

import ctypes

import pytest

from modserve.native import build


@pytest.fixture
def sources(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.cpp").write_text('extern "C" int modserve_answer() { return 42; }\n')
    (src / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCES", src)
    monkeypatch.setenv("MODSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return src


def test_prebuild_compiles_every_source_and_names_a_failure(sources, tmp_path):
    if build.compiler() is None:
        pytest.skip("no C++ compiler")
    results = build.prebuild(workers=2)
    assert set(results) == {"good.cpp", "broken.cpp"}
    assert results["good.cpp"] is None
    assert results["broken.cpp"].startswith("compiling broken.cpp failed")
    (built,) = (tmp_path / "cache" / "kernels").glob("good-*.so")
    assert ctypes.CDLL(str(built)).modserve_answer() == 42
    mtime = built.stat().st_mtime_ns
    assert build.prebuild(workers=1)["good.cpp"] is None and built.stat().st_mtime_ns == mtime  # cached: not rebuilt


def test_a_copy_with_its_own_headers_builds_with_them_not_from_the_cache(tmp_path, monkeypatch):
    """A baseline copy of the kernels (benchmarks' --baseline-source) whose .cpp equals this
    tree's but whose header beside it differs builds from its own header: keyed by the shared
    headers alone, it had loaded this tree's cached build, and an A/B compared a build with itself."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler")
    tree, copy = tmp_path / "tree", tmp_path / "copy"
    for folder, value in ((tree, 1), (copy, 2)):
        folder.mkdir()
        (folder / "answer.cpp").write_text('#include "value.h"\nextern "C" int modserve_answer() { return VALUE; }\n')
        (folder / "value.h").write_text(f"#define VALUE {value}\n")
    monkeypatch.setattr(build, "HEADERS", tree)
    monkeypatch.setenv("MODSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert build.compile_and_load(tree / "answer.cpp", "this tree's kernel").modserve_answer() == 1
    assert build.compile_and_load(copy / "answer.cpp", "the baseline kernel").modserve_answer() == 2
    assert build.compile_and_load(tree / "answer.cpp", "this tree's kernel").modserve_answer() == 1  # each its own cached build
