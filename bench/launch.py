"""Start a modserve server as a subprocess and wait until it serves (benchmarks and tests).

The server prints one start-up line naming its address (``... at http://HOST:PORT/v1``);
with ``--port 0`` that line is the only way to learn the port. Standard library only: the
benchmark scripts run without the test extras.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

START_LINE = re.compile(r"at (http://[^/]+)/v1")


def launch_server(
    module_args: list[str], log_path, timeout: float = 120.0, cwd: str | None = None
) -> tuple[subprocess.Popen, str, str]:
    """Run ``python -m <module_args>`` (in ``cwd``: a checkout's root would put its own
    ``modserve/`` folder ahead of the installed package) with stderr in ``log_path``; once
    ``/health`` answers 200, return the process, its base URL and its start-up line. On
    failure the process is killed."""
    with open(log_path, "w") as log:  # a file, so a chatty log cannot fill a pipe and stall
        proc = subprocess.Popen([sys.executable, "-m", *module_args], stdout=subprocess.PIPE, stderr=log, text=True, cwd=cwd)
    try:
        line = proc.stdout.readline()
        m = START_LINE.search(line)
        if m is None:
            with open(log_path) as f:
                raise RuntimeError(f"no start-up line: {line!r}; log: {f.read()[-2000:]}")
        wait_ready(m.group(1), timeout, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, m.group(1), line


def wait_ready(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url/health`` until it answers 200; raise if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"server at {url} not ready after {timeout}s")
