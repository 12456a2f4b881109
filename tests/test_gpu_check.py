"""``scripts/gpu-check.sh`` in CPU mode: every check that does not need CUDA runs and passes
(Triton interpreted), CUDA graphs are reported as skipped, and a failing check fails the run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_mode_runs_every_check_and_reports():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line.split("  ")[0]: line for line in r.stdout.splitlines() if "  pass  " in line or "  skip  " in line or "FAIL" in line}
    for check in ("parity: torch attention", "parity: triton attention (interpreted)", "INT8 KV (triton vs torch)",
                  "prefix caching", "preemption (by swap)", "speculative decoding (ngram)"):
        assert any(name.startswith(check) and " pass " in line for name, line in rows.items()), r.stdout
    assert any(name.startswith("CUDA graphs (decode)") and " skip " in line for name, line in rows.items())
    assert r.stdout.strip().endswith("6 passed, 0 failed, 2 skipped")
    assert r.stdout.startswith("device: cpu (")


def test_asking_for_cuda_without_one_is_a_clear_error():
    if torch.cuda.is_available():
        return  # the real run is the GPU session's
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "torch sees no CUDA device; use --device cpu" in r.stderr


def test_a_raising_check_fails_alone(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    results = module.run_checks([
        ("boom", lambda: 1 / 0, ""),
        ("wrong", lambda: (False, "3/6 prompts equal"), ""),
        ("fine", lambda: (True, "6/6"), ""),
        ("later", None, "needs a GPU"),
    ])
    assert [(r.name, r.status) for r in results] == [("boom", "FAIL"), ("wrong", "FAIL"), ("fine", "pass"), ("later", "skip")]
    assert results[0].detail == "ZeroDivisionError: division by zero"

