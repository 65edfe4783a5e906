"""What the benchmarks share: child processes timed with their peak RSS, the hardware and
checkpoint facts every table header states, table cells."""

from __future__ import annotations

import json
import math
import os
import platform
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


def run_child(cmd: list[str], log_path: Path) -> ChildRun:
    """Run `cmd`, stdout/stderr into files beside `log_path`; time it and read its rusage via wait4."""
    out_path, err_path = log_path.with_suffix(".out"), log_path.with_suffix(".err")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        # A wide COLUMNS keeps rich from wrapping a child's one-line error over several lines.
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, "COLUMNS": "500"})
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait again
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return ChildRun(proc.returncode, seconds, rss, out_path.read_text(errors="replace"),
                    last_line(err_path.read_text(errors="replace")))


def last_line(text: str) -> str:
    """The last non-empty line (progress bars' carriage returns count as line breaks)."""
    lines = [s.strip() for s in text.replace("\r", "\n").splitlines() if s.strip()]
    return lines[-1][:300] if lines else ""


def json_tail(text: str) -> dict | None:
    """The JSON object on the last line of `text`, or None when there is none."""
    try:
        obj = json.loads(last_line(text))
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def hardware_info() -> dict:
    from importlib.metadata import version

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"cpu": cpu, "cores": cores, "gpu": gpu, "torch": version("torch"), "python": platform.python_version()}


def model_info(model: Path) -> dict:
    """Name, parameter count (from the safetensors headers, nothing loaded) and dtype of a checkpoint."""
    from safetensors import safe_open

    params = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            params += sum(math.prod(st.get_slice(key).get_shape()) for key in st.keys())
    cfg = json.loads((model / "config.json").read_text())
    return {"name": model.name, "path": str(model), "params": params,
            "dtype": cfg.get("dtype") or cfg.get("torch_dtype") or "unknown"}


def fmt_cell(value, spec: str) -> str:
    """A table cell: `value` formatted, or an em dash when there is none."""
    return "—" if value is None else format(value, spec)


def hardware_line(hw: dict) -> str:
    """The `hardware:` header line of every benchmark table (from hardware_info())."""
    return f"hardware: {hw['cpu']}, {hw['cores']} cores, GPU {hw['gpu']}; torch {hw['torch']}, python {hw['python']}"
