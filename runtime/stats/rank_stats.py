"""What each rank of a model holds and spends, for the server's /metrics (runtime/server/metrics.py).

`RankStats` is one rank's row: the bytes of its weights and of its KV cache (fixed once it has
loaded), its process memory, and its time in collectives. Rank 0 (the engine's `ModelRunner`,
runtime/worker/model_runner.py) fills its own row; the executor (runtime/worker/executor.py) the
workers' rows from what the workers themselves report:

- the static numbers (weight and KV bytes) in the worker's "ready" message (`ready_info`);
- its process memory and collective counters, which the worker writes as JSON under
  `stats/<rank>` in the group's TCPStore (`publish_stats`) when it is ready, then after a step
  at most every `PUBLISH_EVERY_S`, and when it goes idle after steps, so a scrape reads a
  value at most about a second old and never asks the worker (nor waits for its steps);
- on CPU with the `mp` executor the driver reads a worker's RSS itself from
  /proc/<pid>/statm (the process is local; fresh at every scrape).

Process memory is the resident set size on CPU and `torch.cuda.memory_allocated` of the rank's
GPU on CUDA. Everything here is plain data (ints, floats, strings): the store is reachable from
other hosts under Ray, so nothing is ever pickled through it.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

PUBLISH_EVERY_S = 1.0  # a stepping worker writes its stats at most this often
IDLE_PUBLISH_S = 0.2  # a worker idle this long after a step writes them (counters complete)
STATS_KEY = "stats/{rank}"  # the worker's published stats in the group's store
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclasses.dataclass(frozen=True)
class RankStats:
    """One rank's resources; None where it is not known (a value a worker has not published)."""

    rank: int
    weight_bytes: int  # parameters and buffers of the rank's model (its shard or stage)
    kv_cache_bytes: int  # the rank's K and V caches
    memory_bytes: int | None  # process RSS (CPU) or torch.cuda.memory_allocated (CUDA)
    comm_seconds: float | None  # cumulative time in all-reduces, gathers, sends and receives
    comm_calls: int | None  # cumulative number of those collectives


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a model holds, each once (tied ones too): parameters, buffers, and
    tensors kept as plain attributes or in a dataclass attribute, such as a QuantLinear's
    repack for the W4A16 kernel (`_prepared`, after which its buffers are empty) or its dense
    copy for the CPU path (runtime/layers/quant_linear.py)."""
    seen: set[tuple] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or not t.numel():
            return
        try:  # the same memory reached as two objects (a view kept beside its base) counts once
            key = (t.data_ptr(), t.nbytes)
        except RuntimeError:  # a tensor without storage of its own (a wrapper subclass)
            key = ("object", id(t))
        if key not in seen:
            seen.add(key)
            total += t.nbytes

    for m in model.modules():
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            add(t)
        for v in vars(m).values():
            add(v)
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                for f in dataclasses.fields(v):
                    add(getattr(v, f.name))
    return total


def rss_bytes(pid: int | str = "self") -> int | None:
    """Resident set size of process `pid` from /proc/<pid>/statm; None when unreadable (a
    process that is gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def process_memory_bytes(device: torch.device) -> int | None:
    """This process's memory on `device`: allocated CUDA memory of that GPU, else the RSS."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return rss_bytes()


def publish_stats(
    store, rank: int, memory: int | None, comm_seconds: float, comm_calls: int
) -> None:
    """A worker's current numbers into the store (JSON: never pickle)."""
    store.set(
        STATS_KEY.format(rank=rank),
        json.dumps(
            {"memory_bytes": memory, "comm_seconds": comm_seconds, "comm_calls": comm_calls}
        ),
    )


def read_published(store, rank: int) -> dict:
    """What rank `rank` last published ({} when nothing, or on any store error); never waits."""
    key = STATS_KEY.format(rank=rank)
    try:
        if not store.check([key]):
            return {}
        value = json.loads(store.get(key))
    except (RuntimeError, ValueError, TypeError):  # a closed store (DistError), bad JSON
        return {}
    return value if isinstance(value, dict) else {}


def _int(value) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def worker_row(
    rank: int, ready: dict, published: dict, memory: int | None = None
) -> RankStats | None:
    """A worker's row from its ready message and published stats; `memory` (read by the driver
    itself) wins over the published one. None without the static numbers."""
    weights, kv = _int(ready.get("weight_bytes")), _int(ready.get("kv_cache_bytes"))
    if weights is None or kv is None:
        return None
    secs = published.get("comm_seconds")
    return RankStats(
        rank,
        weights,
        kv,
        memory if memory is not None else _int(published.get("memory_bytes")),
        float(secs) if isinstance(secs, (int, float)) else None,
        _int(published.get("comm_calls")),
    )
