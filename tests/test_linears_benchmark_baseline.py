"""``benchmarks/cpu_linears.py --baseline-source``: how a change to a panel kernel is measured,
its passes alternated with another revision's build in one process. A copy of ``native/`` whose
header beside the kernel is made wrong must build with that header (not this tree's cached
build) and run alternated with this tree's kernel; each row count's line then reports how far
the two builds' outputs are apart, and this tree's kernel is back in the layers afterwards. Each
kernel's case runs where the CPU has its instructions. ``--against-library`` alternates the
float32 panel layers' passes on their panels with the same layers widened for oneDNN's product."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from modserve.plugins.platforms import cpu, cpu_avx2_linear, cpu_avx512_linear

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # kernel kind, its source, its library, the header made wrong: (text, wrong text), each once
    pytest.param("avx2", "cpu_avx2_linear.cpp", cpu_avx2_linear.load, "float32_panels.h",
                 [("(w + k * 32), 16))};", "(w + k * 32), 15))};"), ("(src), 16)),", "(src), 15)),")],  # even weights, each width's
                 marks=pytest.mark.skipif(cpu.avx2_unavailable() is not None, reason="this CPU has no AVX2 and FMA")),
    pytest.param("avx512bf16", "cpu_avx512_linear.cpp", cpu_avx512_linear.load, "avx512_bf16_panels.h",
                 [("xb, wv[p]);", "xb, wv[0]);")],  # every panel takes its block's first panel's weights: wrong, yet read in bounds
                 marks=pytest.mark.skipif(cpu.avx512_bf16_unavailable() is not None, reason="this CPU has no AVX512_BF16")),
]


def benchmark_recording_its_layers(monkeypatch) -> tuple[object, dict]:
    """``benchmarks/cpu_linears.py`` as a module, and the layers its ``build`` makes, by kind."""
    spec = importlib.util.spec_from_file_location("benchmark_cpu_linears", ROOT / "benchmarks" / "cpu_linears.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built, original = {}, module.build

    def recording_build(k):
        built[k] = original(k)
        return built[k]

    monkeypatch.setattr(module, "build", recording_build)
    return module, built


@pytest.mark.parametrize("kind, source, load, header, edits", CASES)
def test_the_linears_benchmark_times_a_kernel_against_a_baseline_copy(monkeypatch, capsys, tmp_path, kind, source, load,
                                                                       header, edits):
    shutil.copytree(ROOT / "native", tmp_path / "native", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "native" / header
    text = path.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    module, built = benchmark_recording_its_layers(monkeypatch)
    monkeypatch.setattr("sys.argv", ["cpu_linears", "--kernels", kind, "--rows", "1,13", "--repeats", "1",
                                     "--baseline-source", str(tmp_path / "native" / source), "--rounds", "2"])
    module.main()
    out = capsys.readouterr().out
    ab = [line for line in out.splitlines() if "median ratio" in line]
    assert [line.split()[0] for line in ab] == ["1", "13"], out
    assert all(float(line.rsplit("max |diff| ", 1)[1]) > 1.0 for line in ab), out
    ours = load().packed  # this tree's library's entry point
    assert all(m._kernel.packed == ours for group in built[kind].values() for m in group)


@pytest.mark.skipif(cpu.avx2_unavailable() is not None, reason="this CPU has no AVX2 and FMA")
def test_the_linears_benchmark_times_the_panels_against_the_library(monkeypatch, capsys):
    """``--against-library``: each float32 panel kind's passes on the panels and widened for
    oneDNN's product, alternated; the library side does widen (float32_product runs), and the
    layers keep this CPU's choice afterwards."""
    module, built = benchmark_recording_its_layers(monkeypatch)
    products = []
    real_product = cpu_avx2_linear.float32_product
    monkeypatch.setattr(cpu_avx2_linear, "float32_product", lambda *a: products.append(a[0].shape[0]) or real_product(*a))
    monkeypatch.setattr("sys.argv", ["cpu_linears", "--kernels", "avx2,int4-panels-fp32", "--rows", "1,13", "--repeats", "1",
                                     "--against-library", "--rounds", "2"])
    module.main()
    out = capsys.readouterr().out
    assert [line.split(" on its panels")[0] for line in out.splitlines() if "against widened for oneDNN" in line] == ["avx2", "int4-panels-fp32"], out
    ab = [line for line in out.splitlines() if "library/panels" in line]
    assert [line.split()[0] for line in ab] == ["1", "13", "1", "13"], out
    assert all(float(line.rsplit("library/panels ", 1)[1].rstrip("x")) > 0 for line in ab)
    assert set(products) == {1, 13}  # the library side's rows; the panels side never widens
    chosen = {"avx2": cpu.library_from_rows(cpu_avx2_linear.LIBRARY_FROM_ROWS),
              "int4-panels-fp32": cpu.library_from_rows(cpu_avx2_linear.INT4_LIBRARY_FROM_ROWS)}
    assert all(m.library_from_rows == chosen[k] for k in chosen for group in built[k].values() for m in group)
