"""``benchmarks/ab_commits.sh`` refuses a bad round count before it creates anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ab_commits_refuses_a_bad_round_count():
    for bad in ("0", "x", "1.5"):
        r = subprocess.run(["bash", str(ROOT / "benchmarks" / "ab_commits.sh"), "HEAD", bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"ROUNDS: expected an integer >= 1, got '{bad}'" in r.stderr
