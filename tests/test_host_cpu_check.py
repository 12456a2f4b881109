"""``scripts/host-cpu-check.sh`` refuses a bad setting by name before it builds or runs anything
(it is run in a lent machine's few minutes, where a typo must not cost a run)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "host-cpu-check.sh"


@pytest.mark.parametrize("env,message", [
    ({"CORES": "0"}, "CORES: expected a whole number >= 1, got '0'"),
    ({"CONFIGS": "graphs part"}, "CONFIGS: expected graphs and/or parts, got 'part'"),
])
def test_a_bad_setting_exits_2_naming_it(tmp_path, env, message):
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT)], env={**os.environ, "OUT": str(out), **env}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == message, (r.returncode, r.stdout, r.stderr)
    assert not out.exists()  # refused before anything ran
