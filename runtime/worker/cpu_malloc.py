"""glibc's allocator, tuned once for a CPU inference process.

By default glibc serves every allocation above a threshold (128 KiB at first, raised
dynamically up to 32 MiB) with its own mmap and gives it back to the kernel with munmap on
free; the heap is also trimmed whenever 128 KiB at its top are free. An engine step on CPU
allocates and frees activations of a few hundred KiB to tens of MiB in every layer, so each
step maps fresh pages and faults them in again: ~250,000 minor faults and ~1 s of system time
per run of the serving workload of docs/results-serving.md (demo model), measured with getrusage. With the mmap
threshold pinned at its 32 MiB maximum and trimming deferred to 256 MiB, freed activations stay
in the heap for the next layer: ~1,000-50,000 faults and 0.04-0.26 s of system time for the
same run. This is what vLLM gets on CPU by preloading tcmalloc; glibc's own knobs need no extra
library. The cost is that up to 256 MiB of freed heap stays mapped in the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD = 256 * 2**20


@functools.cache
def keep_freed_memory() -> bool:
    """Pin glibc's mmap threshold and defer heap trimming (once per process). False where the
    C library is not glibc (musl, macOS) or refuses the values; nothing changes then."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    if not ok:
        log.debug("mallopt refused the thresholds; the allocator keeps its defaults")
    return ok
