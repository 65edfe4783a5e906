"""How many CPU threads the engine computes with: sized to the cores this process may use, and
re-sized while it runs to the cores other processes leave it.

Why: every op of a CPU step (oneDNN's GEMMs, torch's intra-op loops, our C kernels in
kernels/cpu_*.c) is an OpenMP parallel region that ends at a barrier, and a step is hundreds of
them. With one thread per core and one other busy process on the machine, the kernel's scheduler
takes one of our threads off its core for a time slice at a time, and every barrier waits for
it: on the 2-core box a demo-model run fell from 7,928 to 796 tok/s with one `yes` beside it,
while the same run on one thread gave 6,079 tok/s (docs/results-serving.md, "Sharing the
machine"). So the thread count follows what is free:

- `usable_cores()`: the CPUs this process may run on (`sched_getaffinity`), no more than its
  cgroup's CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`) allows, rounded down: a
  container given 1.5 CPUs computes on one thread instead of being throttled at every barrier;
- `CpuLoad`: every `interval_s` (default 0.5 s) it reads how busy those CPUs were
  (/proc/stat: user, nice, system, irq, softirq and steal, per CPU) and how much of that was this
  process (/proc/self/stat: utime + stime, all its threads): the rest is other processes' work
  (and the hypervisor's, for steal), in cores;
- `ThreadGovernor`: the engine's threads are the usable cores less what the others use, rounded
  to the nearest core (half a core or more taken counts as a core), at least 1. The first
  reading (it spans the model's load) takes effect at once; after that a new count takes effect
  once two readings in a row agree on it (so a short burst of another process does
  not flip it back and forth), by `torch.set_num_threads` on the thread that runs the steps
  (torch's intra-op count is process-wide, OpenMP's, which oneDNN and our C kernels read, is that
  thread's own).

`--cpu-threads N` (EngineConfig.cpu_threads) fixes the count instead; `auto` (the default) is the
above, capped by `OMP_NUM_THREADS` when the environment sets it. The governor runs for a
one-rank engine on the CPU; -tp/-pp ranks keep the fixed share runtime/worker/executor.py gives
them. What it chose is `threads` and `changes` (on /metrics: slimserve:cpu_threads,
slimserve:cpu_thread_changes_total).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slimserve.runtime.config import parse_cpu_threads

AUTO = "auto"
DEFAULT_INTERVAL_S = 0.5
ROUND_AT = 0.5  # cores others use from which one of ours steps aside
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat: user nice system [idle iowait] irq softirq steal


# -- the cores this process may use --------------------------------------------------------------


def _own_cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup folders holding CPU limits, innermost first (v2 unified, then v1)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":
            base = root  # cgroup v2
        elif "cpu" in controllers.split(","):
            base = root / controllers  # v1: /sys/fs/cgroup/cpu,cpuacct/...
            if not base.exists():
                base = root / "cpu"
        else:
            continue
        here = base / rel if rel else base
        while True:  # a limit may sit on any ancestor
            found.append(here)
            if here == base:
                break
            here = here.parent
    return found


def cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPUs this process's cgroups allow (quota / period, the tightest), or None: no limit."""
    limits = []
    for d in _own_cgroup_dirs(root, proc_cgroup):
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]  # v2: "max 100000"
            if quota != "max":
                limits.append(int(quota) / int(period))
            continue
        except (OSError, ValueError):
            pass
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
            if quota > 0 and period > 0:
                limits.append(quota / period)
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None


def affinity() -> list[int]:
    """The CPU numbers this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def usable_cores(cpus: list[int] | None = None, limit: float | None = -1.0) -> int:
    """How many threads can compute at once here: the affinity's CPUs, no more than the cgroup
    quota (rounded down, at least 1). `limit` -1: read it."""
    cpus = affinity() if cpus is None else cpus
    if limit == -1.0:
        limit = cgroup_cpu_limit()
    n = len(cpus)
    if limit is not None:
        n = min(n, max(1, math.floor(limit + 1e-6)))
    return max(1, n)


def env_cap() -> int | None:
    """OMP_NUM_THREADS, when the environment sets a count (the user's upper bound)."""
    text = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


# -- what the other processes use ----------------------------------------------------------------


def read_cpu_busy(cpus: list[int], stat: Path = Path("/proc/stat")) -> int | None:
    """Busy clock ticks of `cpus` since boot (all processes, steal included), None if unreadable."""
    want = {f"cpu{i}" for i in cpus}
    total, seen = 0, 0
    try:
        text = stat.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in want:
            fields = rest.split()
            total += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
            seen += 1
    return total if seen else None


def read_own_ticks(stat: Path = Path("/proc/self/stat")) -> int | None:
    """This process's utime + stime in clock ticks (every thread), None if unreadable."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "
    try:
        return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    except (IndexError, ValueError):
        return None


@dataclass
class CpuLoad:
    """Cores other processes used between two `others()` calls (None: no reading yet)."""

    cpus: list[int]
    clock: Callable[[], float] = time.monotonic
    busy: Callable[[list[int]], int | None] = read_cpu_busy
    own: Callable[[], int | None] = read_own_ticks
    ticks_per_s: int = _TICKS

    def __post_init__(self) -> None:
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int] | None:
        b, o = self.busy(self.cpus), self.own()
        return None if b is None or o is None else (self.clock(), b, o)

    def others(self) -> float | None:
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        dt = now[0] - last[0]
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / self.ticks_per_s / dt)


# -- the choice ----------------------------------------------------------------------------------


def threads_for(cores: int, others: float) -> int:
    """Threads to compute with on `cores` while other processes use `others` cores: one per
    core they leave, a core taken from half its time on (ROUND_AT), at least one."""
    taken = math.floor(others + (1.0 - ROUND_AT) + 1e-9) if others > 0 else 0
    return max(1, min(cores, cores - taken))


class ThreadGovernor:
    """Sets the compute threads of the thread that calls `tick()` (the module docstring).

    setting: "auto" or a fixed count. cores: the most threads auto uses (default: usable_cores()
    capped by OMP_NUM_THREADS). load: what reads the others' use (default: CpuLoad on this
    process's CPUs). apply: how a count takes effect (torch.set_num_threads)."""

    def __init__(
        self,
        setting: int | str = AUTO,
        *,
        cores: int | None = None,
        load: CpuLoad | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        apply: Callable[[int], None] = torch.set_num_threads,
    ):
        self.setting = parse_cpu_threads(setting)
        self.auto = self.setting == AUTO
        if cores is None:
            cores = usable_cores()
            cap = env_cap()
            cores = min(cores, cap) if cap else cores
        self.cores = cores if self.auto else int(self.setting)
        self.interval_s, self.clock, self._apply = interval_s, clock, apply
        self.load = (load or CpuLoad(affinity(), clock=clock)) if self.auto else None
        self.threads = 0  # what was last applied (0: nothing yet)
        self.changes = 0  # times a reading changed it after the first
        self.others: float | None = None  # cores the others used in the last reading
        self._pending: int | None = None
        self.readings = 0
        self._next = clock() + interval_s
        self._set(self.cores)

    def _set(self, n: int) -> None:
        if n != self.threads:
            self.changes += self.threads != 0
            self.threads = n
        self._apply(n)  # also after a test or another caller changed it behind our back

    def tick(self) -> int:
        """Before a step: re-read the load when `interval_s` has passed; the threads in use."""
        if not self.auto:
            if torch.get_num_threads() != self.threads:
                self._apply(self.threads)
            return self.threads
        now = self.clock()
        if now < self._next:
            return self.threads
        self._next = now + self.interval_s
        self.others = self.load.others()
        if self.others is None:
            return self.threads
        want = threads_for(self.cores, self.others)
        self.readings += 1
        if self.readings == 1:  # the first reading spans the model's load: taken at once
            self._set(want)
        elif want == self.threads:
            self._pending = None
        elif want == self._pending:  # two readings in a row
            self._pending = None
            self._set(want)
        else:
            self._pending = want
        return self.threads

    def describe(self) -> str:
        """One line for the startup log and the benchmarks."""
        if not self.auto:
            return f"cpu threads: {self.threads} (fixed, --cpu-threads)"
        return (
            f"cpu threads: auto, {self.threads} of {self.cores} usable cores now (fewer while "
            "other processes keep cores busy; --cpu-threads N fixes it)"
        )
