"""The facts every benchmark table header states: the hardware, and the checkpoint measured."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

from slimserve.kernels.cpu_info import cpu_flags

# Vector extensions that select different CPU matmul kernels (and so different fp32/bf16 rounding):
# the same code measures perplexities that differ in the 5th-6th digit between such hosts.
_ISA_FLAGS = ("avx512_bf16", "avx512f", "avx2")


def hardware_info() -> dict:
    from importlib.metadata import version

    import torch

    cpu, isa = platform.processor() or platform.machine(), "unknown"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in text.splitlines()
            if line.startswith("model name")
        ),
        cpu,
    )
    if flags := cpu_flags(text):
        isa = next((f for f in _ISA_FLAGS if f in flags), "none of " + "/".join(_ISA_FLAGS))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu,
        "isa": isa,
        "cores": cores,
        "gpu": gpu,
        "torch": version("torch"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
    }


def model_info(model: Path) -> dict:
    """Name, parameter count (from the safetensors headers, nothing loaded) and dtype of a checkpoint."""
    from safetensors import safe_open

    params = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            params += sum(math.prod(st.get_slice(key).get_shape()) for key in st.keys())
    cfg = json.loads((model / "config.json").read_text())
    return {
        "name": model.name,
        "path": str(model),
        "params": params,
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype") or "unknown",
    }


def hardware_line(hw: dict) -> str:
    """The `hardware:` header line of every benchmark table (from hardware_info())."""
    isa = f" ({hw['isa']})" if hw.get("isa") else ""
    tf = f", transformers {hw['transformers']}" if hw.get("transformers") else ""
    return (
        f"hardware: {hw['cpu']}{isa}, {hw['cores']} cores, GPU {hw['gpu']}; torch {hw['torch']}{tf}, "
        f"python {hw['python']}"
    )
