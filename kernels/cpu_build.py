"""The CPU kernels written in C (`kernels/*.c`): compiled once per machine with the system C
compiler and loaded through ctypes (kernels/cpu_attention.py and kernels/cpu_layer_ops.py wrap
them; their pure-torch twins are the fallback and the test oracle).

The build: `$CC` (else `cc`, `gcc` or `clang`) with `-O3 -march=native -fopenmp`, retried
without `-march=native`, then without OpenMP (one thread), into
`<cache>/cpu_kernels/<name>-<key>.so` (`kernels/cache_dir.py`); the key hashes the source, the
compiler and its flags, and this CPU's flags, so an edit, another compiler or another CPU builds
again, and a build writes a temporary file renamed into place (two processes building at once
both load a complete library). The sources use only the C library: no Python or torch headers,
so a build takes about a second. The libraries link `libgomp.so.1`, which the dynamic loader
resolves to the copy torch already loaded, so their parallel loops run on torch's own OpenMP
threads. Where no compiler works, `library` returns None and `unavailable_reason` says why;
nothing fails.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from slimserve.kernels.cache_dir import cache_root
from slimserve.kernels.cpu_info import host_cpu_flags

_BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")  # gnu: fused multiply-adds allowed
FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())  # tried in this order
_BUILD_TIMEOUT_S = 120

_reasons: dict[str, list[str]] = {}  # library name -> why it is unavailable


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def _compiler_version(cc: str) -> str:
    """`cc --version`, asked once per process (every library and flag set keys on it)."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _source_with_headers(path: Path) -> bytes:
    """The C source's bytes followed by those of the local headers it includes (`#include
    "x.h"`, beside it), so the cache key changes when a shared header does."""
    source = path.read_bytes()
    headers = re.findall(rb'^#include "([^"/]+)"', source, flags=re.MULTILINE)
    return source + b"".join(b"\0" + path.with_name(h.decode()).read_bytes() for h in headers)


def _cache_key(cc: str, flags: tuple[str, ...], source: bytes) -> str:
    h = hashlib.sha256(source)
    for part in (
        cc,
        _compiler_version(cc),
        " ".join(flags),
        platform.machine(),
        " ".join(sorted(host_cpu_flags())),
    ):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _build(cc: str, flags: tuple[str, ...], source: Path, dest: Path) -> str | None:
    """Compile source into dest (atomically); None, or the compiler's complaint."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.stem}.", suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        cmd = [cc, *_BASE_FLAGS, *flags, str(source), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["no output"])[-1]
        os.replace(tmp, dest)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library(name: str, configure: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """kernels/<name>.c built (or found in the cache) and loaded, `configure` run on it once
    (argument types, initialisation); None where it cannot be built or loaded."""
    reasons = _reasons.setdefault(name, [])
    reasons.clear()
    cc = compiler()
    if cc is None:
        reasons.append("no C compiler (set CC, or install cc/gcc/clang)")
        return None
    path = Path(__file__).with_name(f"{name}.c")
    source = _source_with_headers(path)
    folder = cache_root() / "cpu_kernels"
    for flags in FLAG_SETS:
        dest = folder / f"{name}-{_cache_key(cc, flags, source)}.so"
        if not dest.exists():
            try:
                problem = _build(cc, flags, path, dest)
            except OSError as e:  # the cache folder cannot be created
                problem = str(e)
            if problem is not None:
                reasons.append(f"{cc} {' '.join(flags)}: {problem}")
                continue
        try:
            lib = ctypes.CDLL(str(dest))
            configure(lib)
        except (OSError, AttributeError) as e:
            reasons.append(f"loading {dest}: {e}")
            continue
        return lib
    return None


def unavailable_reason(name: str) -> str:
    """Why `library(name, ...)` returned None ('' when it did not, or was not asked yet)."""
    return "; ".join(_reasons.get(name, []))


def scalar(x: float | torch.Tensor) -> float:
    """A float argument for C from a number or a one-element tensor (the k/v scale buffers)."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


class CLibrary:
    """One C library's handle for its wrapper module: `get()` (the loaded library or None),
    `available()`, `unavailable_reason()`."""

    def __init__(self, name: str, configure: Callable[[ctypes.CDLL], None]):
        self.name, self.configure = name, configure

    def get(self) -> ctypes.CDLL | None:
        return library(self.name, self.configure)

    def available(self) -> bool:
        """Whether it runs here (built on the first call: about a second)."""
        return self.get() is not None

    def unavailable_reason(self) -> str:
        """Why `available()` is False ('' when it is True or was not asked yet)."""
        return unavailable_reason(self.name)
