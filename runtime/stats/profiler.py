"""On-demand torch profiler traces of the engine's steps (`runtime serve --profile-dir DIR`, the
server's POST /start_profile and /stop_profile, runtime/server/app.py).

A `StepProfiler` lives on the engine thread (runtime/engine/async_engine.py hands it the start and stop
commands through the engine's command queue), so the profiler sees the ops of every step it
covers. While it runs, each step is one `slimserve.step` range holding the `slimserve.<phase>`
ranges of runtime/stats/step_timing.py (schedule, prepare, forward, sample, detokenize, output);
activities are the CPU's, plus CUDA's when the engine runs on CUDA; shapes are not recorded
unless asked for. Stopping writes `DIR/<UTC timestamp>-<pid>.trace.json` with
`export_chrome_trace` (Chrome trace JSON: chrome://tracing and https://ui.perfetto.dev open it).

A profile is capped at `max_steps` steps (default PROFILE_MAX_STEPS): the profiler keeps every
event in memory until it stops, so at the cap it stops by itself and writes the trace, which a
later stop returns. A request may ask for fewer steps, never more: its `max_steps` is clamped to
the server's cap. The folder keeps the newest PROFILE_KEEP_TRACES traces: writing one removes
the oldest beyond that. Shutting the engine down (or the engine loop dying) also writes a
running profile's trace.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from slimserve.runtime.stats.step_timing import StepTimings

log = logging.getLogger(__name__)
PROFILE_MAX_STEPS = 200  # steps one profile covers at most (its events stay in memory until then)
PROFILE_KEEP_TRACES = 10  # traces the --profile-dir keeps (the newest); older ones are removed
TRACE_SUFFIX = ".trace.json"


class ProfileError(Exception):
    """A profiling request that cannot be served (the message is one line for the client)."""


class ProfilingDisabled(ProfileError):
    """The server was started without --profile-dir."""


class ProfileStateError(ProfileError):
    """Start while a profile runs, or stop while none does."""


@dataclass(frozen=True)
class ProfileResult:
    path: str  # the trace file written
    steps: int  # engine steps it covers
    capped: bool  # it stopped by itself at max_steps


def prepare_profile_dir(path: str | os.PathLike) -> Path:
    """Create DIR if missing and check that a file can be written in it; ValueError (one line
    naming DIR and the fix) otherwise."""
    d = Path(path).expanduser()
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".slimserve-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"--profile-dir {str(path)!r} is not a writable folder "
            f"({e.strerror or type(e).__name__}); pass a folder this process can "
            "write to"
        ) from None
    return d.resolve()


def trace_path(directory: Path) -> Path:
    """A new file name `<UTC timestamp>-<pid>.trace.json` (a counter is added rather than
    overwrite an existing trace)."""
    stem = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    path, i = directory / f"{stem}{TRACE_SUFFIX}", 1
    while path.exists():
        i += 1
        path = directory / f"{stem}-{i}{TRACE_SUFFIX}"
    return path


def rotate_traces(directory: Path, keep: int = PROFILE_KEEP_TRACES) -> int:
    """Remove all but the newest `keep` traces (by modification time) from `directory`;
    returns how many went. Only `*.trace.json` files are touched."""
    traces = []
    for p in directory.glob(f"*{TRACE_SUFFIX}"):
        try:
            traces.append((p.stat().st_mtime_ns, p.name, p))
        except FileNotFoundError:
            continue
    traces.sort(reverse=True)
    removed = 0
    for _, _, p in traces[keep:]:
        try:
            p.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


class StepProfiler:
    """The engine thread's profiler state: idle, running, or stopped at the cap with its trace
    written and not yet handed out by `stop`. Every method runs on the engine thread."""

    def __init__(
        self,
        directory: Path,
        timings: StepTimings,
        cuda: bool = False,
        max_steps: int = PROFILE_MAX_STEPS,
        keep: int = PROFILE_KEEP_TRACES,
    ) -> None:
        self.directory = directory
        self.timings = timings
        self.cuda = cuda
        self.max_steps = max_steps  # the cap, also the most a request may ask for
        self.keep = keep
        self._prof = None  # the running torch.profiler.profile
        self._limit = max_steps
        self._steps = 0  # steps recorded since the start (timings.recorded counts them)
        self._first = 0  # timings.recorded at the start
        self._capped: ProfileResult | None = None  # written at the cap, returned by the next stop

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self, record_shapes: bool = False, max_steps: int | None = None) -> int:
        """Start profiling the following steps; returns the step cap in force (`max_steps`
        clamped to the server's cap)."""
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            raise ProfileStateError("a profile is already running; POST /stop_profile first")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        prof = profile(activities=activities, record_shapes=record_shapes)
        prof.start()
        self._prof, self._steps, self._capped = prof, 0, None
        self._first = self.timings.recorded
        self._limit = min(max_steps or self.max_steps, self.max_steps)
        self.timings.ranges = True
        return self._limit

    def after_step(self) -> None:
        """After `LLMEngine.step`: count the steps recorded since the start (steps that
        schedule nothing are not, as in runtime/stats/step_timing.py); at the cap stop and write
        the trace."""
        if self._prof is None:
            return
        self._steps = self.timings.recorded - self._first
        if self._steps >= self._limit:
            self._capped = self._finish(capped=True)
            log.warning(
                "profile stopped at its cap of %d steps; trace: %s", self._limit, self._capped.path
            )

    def stop(self) -> ProfileResult:
        """Stop and write the trace (or hand out the one written at the cap)."""
        if self._prof is None:
            if self._capped is not None:
                result, self._capped = self._capped, None
                return result
            raise ProfileStateError("no profile is running; POST /start_profile first")
        return self._finish(capped=False)

    def close(self) -> None:
        """Engine shutdown: write a running profile's trace."""
        if self._prof is not None:
            result = self._finish(capped=False)
            log.warning("profile stopped at shutdown; trace: %s", result.path)

    def _finish(self, capped: bool) -> ProfileResult:
        prof, self._prof = self._prof, None
        self.timings.ranges = False
        assert prof is not None
        prof.stop()
        path = trace_path(self.directory)
        try:
            prof.export_chrome_trace(str(path))
        except OSError as e:
            raise ProfileError(
                f"writing the trace {path.name} failed: {e.strerror or type(e).__name__}"
            ) from None
        try:
            rotate_traces(self.directory, self.keep)
        except OSError:
            log.warning("could not remove old traces from %s", self.directory, exc_info=True)
        return ProfileResult(str(path), self._steps, capped)
