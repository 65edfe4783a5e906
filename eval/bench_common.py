"""What the benchmarks share: child processes timed with their peak RSS and table cells (the
hardware and checkpoint facts every table header states are the runtime bench's:
runtime/bench/sysinfo.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ChildRun:
    returncode: int  # exit code (negative: killed by that signal)
    seconds: float  # wall time from start to reaping
    max_rss_bytes: int  # peak resident set of the child (and any children it reaped)
    stdout: str  # everything it printed on stdout
    stderr_tail: str  # the last meaningful line on stderr ('' when none)


def run_child(cmd: list[str], log_path: Path, env: dict | None = None) -> ChildRun:
    """Run `cmd` (in `env`, default ours), stdout/stderr into files beside `log_path`; time it
    and read its rusage via wait4."""
    out_path, err_path = log_path.with_suffix(".out"), log_path.with_suffix(".err")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        # A wide COLUMNS keeps rich from wrapping a child's one-line error over several lines.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env={**(os.environ if env is None else env), "COLUMNS": "500"},
        )
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait again
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return ChildRun(
        proc.returncode,
        seconds,
        rss,
        out_path.read_text(errors="replace"),
        last_line(err_path.read_text(errors="replace")),
    )


def last_line(text: str) -> str:
    """The last non-empty line (progress bars' carriage returns count as line breaks)."""
    lines = [s.strip() for s in text.replace("\r", "\n").splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""


def json_tail(text: str) -> dict | None:
    """The JSON object on the last line of `text` (however long), or None when there is none."""
    lines = [s.strip() for s in text.replace("\r", "\n").splitlines() if s.strip()]
    try:
        obj = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def fmt_cell(value, spec: str) -> str:
    """A table cell: `value` formatted, or an em dash when there is none."""
    return "—" if value is None else format(value, spec)
