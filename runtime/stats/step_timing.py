"""Per-step timing of the engine: how long each phase of `LLMEngine.step` takes and what the
step's batch held, aggregated as histograms that `/metrics` exports (runtime/server/metrics.py).

The phases, in step order (runtime/engine/llm_engine.py):

| phase | covers |
|---|---|
| `schedule` | `Scheduler.schedule` |
| `prepare` | `ModelRunner.prepare` (the flat batch, its host-to-device copies) |
| `forward` | `ModelRunner.execute` (the model; on CUDA see below) |
| `sample` | the sampler with its one device-to-host copy, and `Scheduler.update` appending the tokens |
| `detokenize` | per sampled request: incremental detokenization and the stop checks (`_check_stop`) |
| `output` | finishing requests and building their `RequestOutput`s |

Always on and cheap: one `perf_counter` per phase boundary, and per step one uncontended lock
and eight bucket look-ups (`bisect`) when the step is recorded; nothing per token. The engine
thread writes; `/metrics` reads a copy taken under the same lock (`StepTimings.snapshot`).
Steps that schedule nothing are not recorded, so every histogram counts the same steps.

CUDA: the forward's kernels are launched asynchronously, so on the host the `forward` phase
only measures the launches and the wait for them lands in `sample` (its device-to-host copy
blocks). Without adding a synchronization, two CUDA events are recorded around the forward and
read once they have completed, normally at the end of the same step because the sampler's copy
has already waited for them (`Event.query()` says so; otherwise at a later step). The step's
`forward` is then the longer of the host's launch time and the GPU's time between the events,
and `sample` gets the rest of the host time of forward + sample (`split_gpu_forward`), so the
phases still add up to the step's wall time. On CPU the host timers are exact.

Profiling (runtime/stats/profiler.py) sets `ranges`: while it is on, each step runs inside a
`torch.profiler.record_function` range `slimserve.step` and each of its phases inside one named
`slimserve.<phase>` (slimserve.schedule, ..., slimserve.output); otherwise no range is made.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PHASES = ("schedule", "prepare", "forward", "sample", "detokenize", "output")
RANGE_PREFIX = "slimserve."  # profiler range names: slimserve.step, slimserve.forward, ...
# seconds per phase and step: 10 us .. 10 s, 1-2.5-5 per decade
PHASE_BUCKETS = tuple(m * 10.0**e for e in range(-5, 1) for m in (1.0, 2.5, 5.0)) + (10.0,)
PREFILL_TOKEN_BUCKETS = (
    0,
    1,
    2,
    4,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
)  # prompt (or recomputed) tokens a step computes
DECODE_ROW_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # decoding sequences
MAX_PENDING_EVENTS = 8  # CUDA steps whose events are unread at most; older ones use host times


@dataclass(frozen=True)
class HistogramData:
    """A histogram's state: per-bucket counts (the last one past every edge), sum and count."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]  # len(edges) + 1, not cumulative
    sum: float
    count: int

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs ending with +Inf, as Prometheus histograms state them."""
        out, total = [], 0
        for edge, n in zip(self.edges, self.counts):
            total += n
            out.append((_le(edge), float(total)))
        out.append(("+Inf", float(self.count)))
        return out


def _le(edge: float) -> str:
    return repr(float(edge))


class _Histogram:
    __slots__ = ("edges", "counts", "sum", "count")

    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.edges, value)] += 1  # Prometheus buckets: value <= le
        self.sum += value
        self.count += 1

    def data(self) -> HistogramData:
        return HistogramData(self.edges, tuple(self.counts), self.sum, self.count)


@dataclass(frozen=True)
class StepTimingSnapshot:
    """Everything recorded so far (cumulative since the engine started)."""

    phases: dict[str, HistogramData]  # phase name -> seconds per step
    prefill_tokens: HistogramData  # per step
    decode_rows: HistogramData  # per step

    @property
    def steps(self) -> int:
        return self.prefill_tokens.count


def split_gpu_forward(
    host_forward: float, host_sample: float, gpu_forward: float
) -> tuple[float, float]:
    """(forward, sample) seconds of a CUDA step: the forward takes the longer of its launches on
    the host and its run on the GPU; sample keeps what is left of the two host phases (>= 0)."""
    forward = max(host_forward, gpu_forward)
    return forward, max(0.0, host_forward + host_sample - forward)


def batch_composition(items: list) -> tuple[int, int]:
    """(prefill tokens, decode rows) of a step's `ScheduledSeq`s (runtime/engine/scheduler.py): a
    decode row computes one output token; every other scheduled token (prompt chunks, and
    tokens recomputed after a preemption) is prefill."""
    prefill = rows = 0
    for s in items:
        if s.num_new_tokens == 1 and s.start >= s.seq.num_prompt_tokens:
            rows += 1
        else:
            prefill += s.num_new_tokens
    return prefill, rows


def _cuda_event() -> Any:
    import torch

    return torch.cuda.Event(enable_timing=True)


class StepTimings:
    """The histograms of one engine. `begin()` starts a step's clock (engine thread only);
    `snapshot()` may be called from any thread.

    cuda: time the forward with CUDA events (see the module docstring), recorded on the current
    stream of `device` (the engine thread's current device may be another one); event_factory:
    makes one timing event (tests pass a fake; default `torch.cuda.Event(enable_timing=True)`).
    """

    def __init__(
        self, cuda: bool = False, event_factory: Callable[[], Any] | None = None, device: Any = None
    ) -> None:
        self.cuda = cuda
        self.device = device  # torch.device of the forward; None: the current device
        self.ranges = False  # profiler ranges around each phase (set by runtime/stats/profiler.py)
        self.recorded = 0  # steps recorded so far (engine thread)
        self._lock = threading.Lock()
        self._phases = {p: _Histogram(PHASE_BUCKETS) for p in PHASES}
        self._prefill = _Histogram(PREFILL_TOKEN_BUCKETS)
        self._rows = _Histogram(DECODE_ROW_BUCKETS)
        self._event_factory = event_factory or _cuda_event
        self._free_events: list[Any] = []
        # CUDA steps whose forward events were not complete yet: (host forward, host sample,
        # start event, end event)
        self._pending: list[tuple[float, float, Any, Any]] = []

    @classmethod
    def for_device(cls, device: Any) -> StepTimings:
        """The timings of an engine whose model runs on `device` (a torch.device)."""
        cuda = device.type == "cuda"
        return cls(cuda=cuda, device=device if cuda else None)

    def begin(self) -> StepClock:
        """Start a step in its `schedule` phase."""
        return StepClock(self)

    def snapshot(self) -> StepTimingSnapshot:
        with self._lock:
            return StepTimingSnapshot(
                {p: h.data() for p, h in self._phases.items()},
                self._prefill.data(),
                self._rows.data(),
            )

    # -- engine thread ---------------------------------------------------------------------------

    def _event(self) -> Any:
        return self._free_events.pop() if self._free_events else self._event_factory()

    def _mark(self, event: Any) -> None:
        if self.device is None:
            event.record()
        else:
            import torch

            event.record(torch.cuda.current_stream(self.device))

    def _record(
        self, durations: list[float], prefill: int, rows: int, events: tuple[Any, Any] | None
    ) -> None:
        self.recorded += 1
        ready = []
        if events is not None:
            self._pending.append((durations[2], durations[3], *events))
            ready = self._ready_pending()
        with self._lock:
            for name, seconds in zip(PHASES, durations):
                if events is None or name not in ("forward", "sample"):
                    self._phases[name].observe(seconds)
            for forward, sample in ready:
                self._phases["forward"].observe(forward)
                self._phases["sample"].observe(sample)
            self._prefill.observe(prefill)
            self._rows.observe(rows)

    def _ready_pending(self) -> list[tuple[float, float]]:
        """(forward, sample) of every pending CUDA step whose end event has completed, oldest
        first; past MAX_PENDING_EVENTS the oldest is taken with its host times."""
        out = []
        while self._pending:
            host_f, host_s, start, end = self._pending[0]
            if end.query():
                out.append(split_gpu_forward(host_f, host_s, start.elapsed_time(end) / 1e3))
            elif len(self._pending) > MAX_PENDING_EVENTS:
                out.append((host_f, host_s))
            else:
                break
            self._pending.pop(0)
            self._free_events += (start, end)
        return out


class StepClock:
    """One step's phase boundaries (engine thread). `next(phase)` ends the current phase and
    starts `phase`, in the order of PHASES; `finish` records the step, `cancel` drops it."""

    __slots__ = ("_events", "_range", "_stamps", "_step_range", "_timings")

    def __init__(self, timings: StepTimings) -> None:
        self._timings = timings
        self._range: Any = None  # the phase's profiler range, while profiling
        self._step_range: Any = None  # the step's
        self._events: tuple[Any, Any] | None = None
        if timings.ranges:
            self._step_range = _open_range("step")
            self._enter("schedule")
        self._stamps = [time.perf_counter()]

    def _enter(self, phase: str) -> None:
        """Close the current phase's range; open `phase`'s (none for "")."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
        self._range = _open_range(phase) if phase else None

    def _close(self) -> None:
        if self._step_range is not None:
            self._enter("")
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def next(self, phase: str) -> None:
        now = time.perf_counter()
        assert phase == PHASES[len(self._stamps)], (phase, len(self._stamps))
        self._stamps.append(now)
        t = self._timings
        if t.cuda:
            if phase == "forward":
                self._events = (t._event(), t._event())
                t._mark(self._events[0])
            elif phase == "sample":
                t._mark(self._events[1])  # type: ignore[index]
        if self._range is not None:
            self._enter(phase)

    def finish(self, prefill_tokens: int, decode_rows: int) -> None:
        """End the `output` phase and record the step with its batch composition."""
        now = time.perf_counter()
        assert len(self._stamps) == len(PHASES), len(self._stamps)
        self._close()
        stamps = self._stamps + [now]
        durations = [b - a for a, b in zip(stamps, stamps[1:])]
        self._timings._record(durations, prefill_tokens, decode_rows, self._events)

    def cancel(self) -> None:
        """A step that ran nothing: close its ranges, record nothing."""
        self._close()
        if self._events is not None:
            self._timings._free_events += self._events


def _open_range(name: str) -> Any:
    from torch.profiler import record_function

    r = record_function(RANGE_PREFIX + name)
    r.__enter__()
    return r
