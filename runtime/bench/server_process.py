"""The `runtime serve` child process a benchmark measures: start it on a free port, wait until
/health answers, stop it (SIGTERM, then kill after a grace period) when the block ends.

runtime/bench/driver.py decides what to serve (the command line); this module only runs it.
"""

from __future__ import annotations

import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

STOP_GRACE_S = 30  # s the served engine gets to exit on SIGTERM before it is killed


class BenchError(RuntimeError):
    """The benchmark could not run (server did not start, warm-up failed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


@contextmanager
def launched_server(cmd: list[str], url: str, timeout_s: float, log_path: Path) -> Iterator[str]:
    """Run `cmd` (a server listening at url) until the block ends; yields url once /health is 200."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise BenchError(f"`runtime serve` exited with code {proc.returncode} before it was "
                                 f"ready: {_last_line(log_path)} (log: {log_path})")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"`runtime serve` did not answer /health within {timeout_s:.0f} s "
                                 f"(log: {log_path}); raise server_start_timeout_s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()  # uvicorn shuts down gracefully on SIGTERM
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
