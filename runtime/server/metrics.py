"""Prometheus metrics of one server: engine gauges read at scrape time, per-request latencies.

Names follow vLLM's (`vllm:num_requests_running` -> `slimserve:num_requests_running`, same
suffixes and histogram bucket edges), so a vLLM dashboard works after renaming the prefix. Each
app owns its CollectorRegistry: several apps (tests, two models in one process) never collide.

Engine step timing (runtime/stats/step_timing.py) has no vLLM counterpart: `slimserve:step_phase_seconds`
is one histogram labelled by `phase` (schedule, prepare, forward, sample, detokenize, output;
seconds per step, buckets 10 us .. 10 s), beside `slimserve:step_prefill_tokens` and
`slimserve:step_decode_rows` (per step). The engine thread only counts into its own buckets;
they become metric families at scrape time from a copy taken under the engine's lock, so the
step loop never touches a prometheus object.

Ranks (engine.rank_stats(), runtime/stats/rank_stats.py), labelled `rank` (rank 0 only in
one process): gauges `slimserve:rank_weight_bytes`, `slimserve:rank_kv_cache_bytes` and
`slimserve:rank_memory_bytes` (process RSS on CPU, `torch.cuda.memory_allocated` of the rank's
GPU on CUDA), and with tensor/pipeline parallelism the counters
`slimserve:tp_collective_seconds_total` and `slimserve:tp_collective_calls_total` (rank 0's
fresh; a worker's as it last published them, at most about a second old). A worker that has died
has no row, and a failure to read them leaves them out instead of failing the scrape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from slimserve.runtime.engine.sequence import RequestOutput
from slimserve.runtime.errors import EngineDeadError
from slimserve.runtime.stats.rank_stats import RankStats
from slimserve.runtime.stats.step_timing import HistogramData, StepTimingSnapshot

log = logging.getLogger(__name__)
P = "slimserve:"
# seconds; vLLM's edges for the same histograms
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
STEP_PHASE_SECONDS = P + "step_phase_seconds"  # label phase; runtime/bench/breakdown.py reads these
STEP_PREFILL_TOKENS = P + "step_prefill_tokens"
STEP_DECODE_ROWS = P + "step_decode_rows"
TP_COLLECTIVE_SECONDS = P + "tp_collective_seconds"  # counters: rendered with _total; label rank
TP_COLLECTIVE_CALLS = P + "tp_collective_calls"  # runtime/bench/breakdown.py reads both
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """Gauges and cumulative counters straight from engine.stats(), fresh at every scrape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def _families(self, stats: Any) -> list[Metric]:
        g = [
            ("num_requests_running", "Requests in the running batch.", "num_running"),
            (
                "num_requests_waiting",
                "Requests queued or preempted, waiting for KV blocks.",
                "num_waiting",
            ),
            (
                "kv_cache_usage_perc",
                "Fraction of KV-cache blocks held by live sequences (0-1).",
                "kv_cache_usage",
            ),
            (
                "prefix_cache_hit_rate",
                "Cumulative fraction of prompt tokens served by the prefix cache (0-1).",
                "prefix_cache_hit_rate",
            ),
            (
                "kv_cache_capacity_tokens",
                "Tokens the KV cache holds (blocks x block size).",
                "capacity_tokens",
            ),
            (
                "cpu_threads",
                "CPU threads the engine computes with now (0: not governed, e.g. on CUDA).",
                "cpu_threads",
            ),
        ]
        out: list[Metric] = []
        for name, doc, attr in g:
            value = None if stats is None else float(getattr(stats, attr))
            out.append(GaugeMetricFamily(P + name, doc, value=value))
        out.append(
            CounterMetricFamily(
                P + "num_preemptions",
                "Cumulative sequence preemptions (KV freed, recomputed later).",
                value=None if stats is None else stats.num_preemptions,
            )
        )
        out.append(
            CounterMetricFamily(
                P + "cpu_thread_changes",
                "Times the engine changed its CPU threads to the cores other processes left.",
                value=None if stats is None else stats.cpu_thread_changes,
            )
        )
        return out

    def describe(self) -> list[Metric]:
        return self._families(None)  # names only: registering must not call the engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except EngineDeadError:  # /health reports it; the request metrics still render
            return
        yield from self._families(stats)


class _StepTimingCollector(Collector):
    """The engine's step histograms (engine.step_timing(): a copy), fresh at every scrape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @staticmethod
    def _families(snap: StepTimingSnapshot | None) -> list[Metric]:
        phases = HistogramMetricFamily(
            STEP_PHASE_SECONDS,
            "Time of one engine step's phase (runtime/stats/step_timing.py), per step.",
            labels=["phase"],
        )
        prefill = HistogramMetricFamily(
            STEP_PREFILL_TOKENS, "Prompt (and recomputed) tokens one engine step computes."
        )
        rows = HistogramMetricFamily(
            STEP_DECODE_ROWS, "Sequences one engine step decodes a token for."
        )
        if snap is not None:
            for phase, h in snap.phases.items():
                _add(phases, h, [phase])
            _add(prefill, snap.prefill_tokens)
            _add(rows, snap.decode_rows)
        return [phases, prefill, rows]

    def describe(self) -> list[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.engine.step_timing())


class _RankCollector(Collector):
    """Per-rank memory and collective counters (engine.rank_stats()), fresh at every scrape."""

    GAUGES = (
        ("rank_weight_bytes", "Bytes of the rank's weights (its shard or stage).", "weight_bytes"),
        ("rank_kv_cache_bytes", "Bytes of the rank's KV cache.", "kv_cache_bytes"),
        (
            "rank_memory_bytes",
            "The rank's process memory: RSS on CPU, "
            "torch.cuda.memory_allocated of its GPU on CUDA.",
            "memory_bytes",
        ),
    )

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @classmethod
    def _families(cls, rows: list[RankStats]) -> list[Metric]:
        out: list[Metric] = []
        for name, doc, attr in cls.GAUGES:
            g = GaugeMetricFamily(P + name, doc, labels=["rank"])
            for r in rows:
                if (v := getattr(r, attr)) is not None:
                    g.add_metric([str(r.rank)], float(v))
            out.append(g)
        secs = CounterMetricFamily(
            TP_COLLECTIVE_SECONDS,
            "Time the rank spent in collectives "
            "(all-reduces, gathers, pipeline sends and receives; on CUDA the "
            "host's enqueue time).",
            labels=["rank"],
        )
        calls = CounterMetricFamily(
            TP_COLLECTIVE_CALLS, "Collectives the rank ran.", labels=["rank"]
        )
        for r in rows:
            if r.comm_seconds is not None and r.comm_calls is not None:
                secs.add_metric([str(r.rank)], r.comm_seconds)
                calls.add_metric([str(r.rank)], r.comm_calls)
        return out + [secs, calls]

    def describe(self) -> list[Metric]:
        return self._families([])

    def collect(self) -> Iterator[Metric]:
        try:
            rows = self.engine.rank_stats()
        except Exception:  # noqa: BLE001 (the rest of the scrape must still render)
            log.debug("per-rank stats unavailable", exc_info=True)
            return
        yield from self._families(rows)


def _add(family: HistogramMetricFamily, h: HistogramData, labels: list[str] | None = None) -> None:
    family.add_metric(labels or [], h.cumulative(), h.sum)


class ServerMetrics:
    """Every metric of one app, in its own registry."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_EngineCollector(engine))
        r.register(_StepTimingCollector(engine))
        r.register(_RankCollector(engine))
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Time from arrival to the request's end.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(
            P + "request_success",
            "Finished requests by reason (stop, length, abort).",
            ["finished_reason"],
            registry=r,
        )
        self.request_rejected = Counter(
            P + "request_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=r,
        )

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Feeds one request's updates into the histograms and counters."""

    def __init__(self, m: ServerMetrics) -> None:
        self.m = m
        self.created = time.monotonic()  # fallback arrival time if the engine gives none
        self.num_tokens = 0  # generated tokens seen so far
        self.last_token: float | None = None  # monotonic s of the latest token seen
        self.started = False  # prompt tokens counted
        self.done = False  # end recorded

    def update(self, out: RequestOutput) -> None:
        """Account one delta output of the request."""
        t = out.metrics
        if not self.started:
            self.started = True
            self.m.prompt_tokens.inc(len(out.prompt_token_ids))
        new = len(out.outputs[0].token_ids)  # outputs are deltas: every token in one is new
        if new > 0:
            self.m.generation_tokens.inc(new)
            now = t.get("last_token", time.monotonic())
            if self.last_token is None:
                self.last_token = t.get("first_token", now)
                self.m.ttft.observe(self.last_token - t.get("arrival", self.created))
                new -= 1
            # Updates can bundle tokens of several steps (a slow consumer): spread the gap evenly.
            for _ in range(new):
                self.m.itl.observe((now - self.last_token) / new)
            self.last_token = now
            self.num_tokens += len(out.outputs[0].token_ids)
        if out.finished:
            self.finish(out.outputs[0].finish_reason or "abort", out)

    def finish(self, reason: str, out: RequestOutput | None = None) -> None:
        if self.done:
            return
        self.done = True
        t = out.metrics if out is not None else {}
        self.m.e2e.observe(t.get("finish", time.monotonic()) - t.get("arrival", self.created))
        self.m.request_success.labels(finished_reason=reason).inc()
