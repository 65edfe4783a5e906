"""The `runtime serve` child process a benchmark measures: start it on a free port, wait until
/health answers, stop it (SIGTERM, then kill after a grace period) when the block ends.

runtime/bench/driver.py decides what to serve (the command line, `serve_cmd` + the options'
words from runtime/serve_options.py); this module only runs it.
`runtime serve --data-parallel-size N` starts its replicas with `launched_servers` (all at once,
then waits for each; on Linux each child also gets SIGTERM if the parent dies, so none outlives
it).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

STOP_GRACE_S = 30  # s the served engine gets to exit on SIGTERM before it is killed
SERVE_MODULE = "slimserve.runtime.cli"  # `python -m` this, then `serve`: the `runtime serve` CLI


class BenchError(RuntimeError):
    """The benchmark could not run (server did not start, warm-up failed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(argv: list[str]) -> list[str]:
    """`runtime serve ARGV` as a child process's command line (this interpreter)."""
    return [sys.executable, "-m", SERVE_MODULE, "serve", *argv]


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(no output)"


def _die_with_parent() -> None:  # runs in the child between fork and exec (Linux only)
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ServerSpec:
    """One child server: its command line, the URL it listens at, its environment (None: the
    parent's) and log file (None: the parent's stdout/stderr)."""

    cmd: list[str]
    url: str
    env: dict[str, str] | None = None
    log_path: Path | None = None


def start_server(spec: ServerSpec, die_with_parent: bool = False) -> subprocess.Popen:
    preexec = _die_with_parent if die_with_parent and sys.platform.startswith("linux") else None
    if spec.log_path is None:
        return subprocess.Popen(spec.cmd, env=spec.env, preexec_fn=preexec)
    with open(spec.log_path, "wb") as log:
        return subprocess.Popen(
            spec.cmd, stdout=log, stderr=subprocess.STDOUT, env=spec.env, preexec_fn=preexec
        )


def wait_ready(proc: subprocess.Popen, spec: ServerSpec, deadline: float) -> None:
    """Return once the server answers /health with 200; BenchError if it exits or the monotonic
    `deadline` passes first."""
    where = f" (log: {spec.log_path})" if spec.log_path else ""
    while True:
        if proc.poll() is not None:
            last = f": {_last_line(spec.log_path)}" if spec.log_path else ""
            raise BenchError(
                f"`runtime serve` exited with code {proc.returncode} before it was "
                f"ready{last}{where}"
            )
        try:
            if httpx.get(spec.url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise BenchError(
                f"`runtime serve` at {spec.url} did not answer /health in time"
                f"{where}; raise the start timeout"
            )
        time.sleep(0.25)


def stop_servers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to all (uvicorn shuts down gracefully), then kill whoever is left after the grace."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def launched_servers(
    specs: list[ServerSpec], timeout_s: float, die_with_parent: bool = True
) -> Iterator[list[subprocess.Popen]]:
    """Start every server at once, wait until each answers /health, stop all when the block ends
    (also on an error or Ctrl-C while they start)."""
    procs: list[subprocess.Popen] = []
    try:
        for spec in specs:
            procs.append(start_server(spec, die_with_parent))
        deadline = time.monotonic() + timeout_s
        for proc, spec in zip(procs, specs):
            wait_ready(proc, spec, deadline)
        yield procs
    finally:
        stop_servers(procs)


@contextmanager
def launched_server(
    cmd: list[str], url: str, timeout_s: float, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Run `cmd` (a server listening at url; `env`: its environment, None: ours) until the block
    ends; yields url once /health is 200."""
    with launched_servers(
        [ServerSpec(cmd, url, env, log_path=log_path)], timeout_s, die_with_parent=False
    ):
        yield url
