"""Where slimserve keeps what it builds once per machine and reuses: the compiled CPU kernels
(kernels/cpu_build.py) and GGUF checkpoints converted to HF folders (runtime/loading/gguf.py)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SLIMSERVE_CACHE"


def cache_root() -> Path:
    """$SLIMSERVE_CACHE, else $XDG_CACHE_HOME/slimserve, else ~/.cache/slimserve."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "slimserve"
    )
