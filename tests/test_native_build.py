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
