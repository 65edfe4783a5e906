"""The facts every benchmark table header states: the hardware, and the checkpoint measured."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path


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


def hardware_line(hw: dict) -> str:
    """The `hardware:` header line of every benchmark table (from hardware_info())."""
    return f"hardware: {hw['cpu']}, {hw['cores']} cores, GPU {hw['gpu']}; torch {hw['torch']}, python {hw['python']}"
