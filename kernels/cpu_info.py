"""What the host CPU can do, from its /proc/cpuinfo flags (Linux; empty elsewhere): read by the
CPU dtype choice (runtime/dtypes.py), the benchmarks' hardware header and the compiled CPU
kernels' cache key (kernels/cpu_attention.py)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first flags line of a /proc/cpuinfo text (`flags` on x86, `Features` on aarch64)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (`cpu_flags` of /proc/cpuinfo); empty off Linux or unreadable."""
    if platform.system() != "Linux":
        return frozenset()
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()
