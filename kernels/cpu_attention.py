"""Paged decode attention on the CPU without a gather: kernels/cpu_attention.c, compiled once per
machine with the system C compiler and called through ctypes.

Why C: the pure-torch twin (`reference_attention.paged_attention`) copies every decoding
sequence's whole context out of the paged cache (`index_select`) at every layer of every step
before torch's SDPA reads the copy again, so each cached K/V byte crosses memory three times; in
the serving benchmark that gather and SDPA were 40% of a step. The C kernel reads each key and
value once, in place, for the whole group of query heads that shares it (GQA), and runs the
(sequence, KV head) tasks on torch's own OpenMP threads: the library links `libgomp.so.1`, which
the dynamic loader resolves to the copy torch already loaded, so both share one thread pool.

The build: `$CC` (else `cc`, `gcc` or `clang`) with `-O3 -march=native -fopenmp`, retried
without `-march=native`, then without OpenMP (one thread), into
`<cache>/cpu_kernels/cpu_attention-<key>.so` (`kernels/cache_dir.py`); the key hashes the
source, the compiler and its flags, and this CPU's flags, so an edit, another compiler or
another CPU builds again, and a build writes a temporary file renamed into place (two processes
building at once both load a complete library). Where no compiler works, `available()` is False,
the reason is kept in `unavailable_reason()`, and the engine uses the torch twin: nothing fails.
`SLIMSERVE_KERNELS=torch` also selects the twin (runtime/layers/ops.py).

Caches: fp32, bf16 and float8_e4m3fn (dequantized with k_scale / v_scale). fp16 caches are not
handled here (`supports` says so) and stay on the twin.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from slimserve.kernels.cache_dir import cache_root
from slimserve.kernels.cpu_info import host_cpu_flags

SOURCE = Path(__file__).with_name("cpu_attention.c")
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")  # gnu: fused multiply-adds allowed
_FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())  # tried in this order
_BUILD_TIMEOUT_S = 120

_reason: list[str] = []  # why the library is unavailable (filled by _library)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_key(compiler: str, flags: tuple[str, ...], source: bytes) -> str:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256(source)
    for part in (compiler, version, " ".join(flags), platform.machine(), " ".join(sorted(host_cpu_flags()))):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _build(compiler: str, flags: tuple[str, ...], dest: Path) -> str | None:
    """Compile SOURCE into dest (atomically); None, or the compiler's complaint."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.stem}.", suffix=".so", dir=dest.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_BASE_FLAGS, *flags, str(SOURCE), "-o", tmp, "-lm"]
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
def _library() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        _reason.append("no C compiler (set CC, or install cc/gcc/clang)")
        return None
    source = SOURCE.read_bytes()
    folder = cache_root() / "cpu_kernels"
    for flags in _FLAG_SETS:
        dest = folder / f"cpu_attention-{_cache_key(compiler, flags, source)}.so"
        if not dest.exists():
            try:
                problem = _build(compiler, flags, dest)
            except OSError as e:  # the cache folder cannot be created
                problem = str(e)
            if problem is not None:
                _reason.append(f"{compiler} {' '.join(flags)}: {problem}")
                continue
        try:
            lib = ctypes.CDLL(str(dest))
        except OSError as e:
            _reason.append(f"loading {dest}: {e}")
            continue
        lib.slimserve_cpu_attention_init()
        fn = lib.slimserve_paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_int]
        return lib
    return None


def available() -> bool:
    """Whether the compiled kernel can run here (builds it on the first call: ~1 s)."""
    return _library() is not None


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True or was not asked yet)."""
    return "; ".join(_reason)


def supports(cache_dtype: torch.dtype) -> bool:
    """Whether caches of this dtype can be read by the kernel (fp32, bf16, float8_e4m3fn)."""
    return cache_dtype in _KINDS


def _scalar(x: float | torch.Tensor) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """`reference_attention.paged_attention_decode` on CPU tensors, read in place: query [B, H, D]
    (any float dtype), caches [num_blocks, block_size, Hkv, D] (`supports`), block_tables int
    [B, max_blocks], context_lens int [B] (0 gives a zero row) -> [B, H, D] in query's dtype."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {unavailable_reason()}")
    if key_cache.dtype != value_cache.dtype or not supports(key_cache.dtype):
        raise ValueError(f"CPU attention reads fp32, bf16 or fp8 caches, not {key_cache.dtype}/{value_cache.dtype}")
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        raise ValueError("CPU attention takes CPU tensors")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("CPU attention needs contiguous caches")
    n, heads, dim = query.shape
    _, block_size, kv_heads, cache_dim = key_cache.shape
    if cache_dim != dim or heads % kv_heads:
        raise ValueError(f"query [{n}, {heads}, {dim}] does not match caches of {kv_heads} heads x {cache_dim}")
    q = query.to(torch.float32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if tables.shape[0] != n or lens.shape[0] != n:
        raise ValueError(f"{n} queries but {tables.shape[0]} block tables and {lens.shape[0]} lengths")
    out = torch.empty(n, heads, dim, dtype=torch.float32)
    if n == 0:
        return out.to(query.dtype)
    rc = lib.slimserve_paged_decode_attention(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), _KINDS[key_cache.dtype],
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), out.data_ptr(), n, heads, kv_heads,
        dim, block_size, key_cache.shape[0], float(scale), _scalar(k_scale), _scalar(v_scale),
        torch.get_num_threads())
    if rc == -2:
        raise ValueError("a context length or block id lies outside the block tables or the cache")
    if rc != 0:
        raise MemoryError("CPU attention could not allocate its scores buffer")
    return out if query.dtype == torch.float32 else out.to(query.dtype)
