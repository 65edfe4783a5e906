"""Where a benchmark run's engine time went: the server's step histograms (runtime/stats/step_timing.py,
exported by runtime/server/metrics.py) scraped from /metrics before and after the measured run
and subtracted, so warm-up and earlier runs do not count (other clients of the same server do).

`step_breakdown(before, after)` gives per phase the total seconds, milliseconds per step and
share of the step time, plus the mean prefill tokens and decode rows per step, and, when the
server is split over ranks (`-tp`/`-pp`) and exports `slimserve:tp_collective_seconds_total`,
rank 0's time in collectives (all-reduces, the logits gather, pipeline transfers: part of the
forward phase, including the wait for the slowest rank) per step and as a share of the step
time; None when either
scrape lacks the histograms (an older slimserve, a router, another product), and the benchmark
then says so in one line instead of printing the table. Parsing uses prometheus_client's own
text parser.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from slimserve.runtime.server.metrics import (
    STEP_DECODE_ROWS,
    STEP_PHASE_SECONDS,
    STEP_PREFILL_TOKENS,
    TP_COLLECTIVE_CALLS,
    TP_COLLECTIVE_SECONDS,
)
from slimserve.runtime.stats.step_timing import PHASES

# (sum, count) of each histogram series: "phase:<name>" for the phases, else the metric name;
# COLLECTIVES: rank 0's (collective seconds, collective calls) counters
StepTotals = dict[str, tuple[float, float]]
COLLECTIVES = "collectives:rank0"


def parse_step_totals(text: str) -> StepTotals | None:
    """The _sum and _count of every step histogram in a /metrics text; None when the phase
    histogram is missing (or the text is not Prometheus' format)."""
    totals: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            counter = family.name.removesuffix("_total")  # typed, or untyped (name_total)
            if counter in (TP_COLLECTIVE_SECONDS, TP_COLLECTIVE_CALLS):
                for sample in family.samples:
                    if sample.name.endswith("_total") and sample.labels.get("rank") == "0":
                        totals.setdefault(COLLECTIVES, [0.0, 0.0])[
                            counter == TP_COLLECTIVE_CALLS
                        ] = float(sample.value)
                continue
            if family.name not in (STEP_PHASE_SECONDS, STEP_PREFILL_TOKENS, STEP_DECODE_ROWS):
                continue
            for sample in family.samples:
                kind = sample.name[len(family.name) :]
                if kind not in ("_sum", "_count"):
                    continue
                key = (
                    f"phase:{sample.labels.get('phase')}"
                    if family.name == STEP_PHASE_SECONDS
                    else family.name
                )
                totals.setdefault(key, [0.0, 0.0])[kind == "_count"] = float(sample.value)
    except (ValueError, TypeError):  # not the exposition format: no breakdown
        return None
    if not any(k.startswith("phase:") for k in totals):
        return None
    return {k: (v[0], v[1]) for k, v in totals.items()}


def step_breakdown(before: StepTotals | None, after: StepTotals | None) -> dict | None:
    """The run's breakdown from the totals before and after it; None if either is None."""
    if before is None or after is None:
        return None

    def diff(key: str) -> tuple[float, float]:
        (s0, c0), (s1, c1) = before.get(key, (0.0, 0.0)), after.get(key, (0.0, 0.0))
        return s1 - s0, c1 - c0

    phase_s = {p: diff(f"phase:{p}")[0] for p in PHASES if f"phase:{p}" in after}
    steps = int(max((diff(f"phase:{p}")[1] for p in phase_s), default=0))
    total = sum(phase_s.values())
    phases = [
        {
            "phase": p,
            "total_s": s,
            "ms_per_step": 1e3 * s / steps if steps else None,
            "share": s / total if total > 0 else None,
        }
        for p, s in phase_s.items()
    ]

    def mean(key: str) -> float | None:
        s, c = diff(key)
        return s / c if c else None

    collectives = None
    if COLLECTIVES in after:
        secs, calls = diff(COLLECTIVES)
        collectives = {
            "rank": 0,
            "total_s": secs,
            "calls": int(calls),
            "ms_per_step": 1e3 * secs / steps if steps else None,
            "calls_per_step": calls / steps if steps else None,
            "share": secs / total if total > 0 else None,
        }
    return {
        "steps": steps,
        "step_time_s": total,
        "phases": phases,
        "mean_prefill_tokens": mean(STEP_PREFILL_TOKENS),
        "mean_decode_rows": mean(STEP_DECODE_ROWS),
        "collectives": collectives,
    }


def scrape_step_totals(
    url: str, api_key: str | None = None, timeout_s: float = 10.0
) -> StepTotals | None:
    """GET url/metrics and parse the step histograms; None when that fails in any way."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse_step_totals(r.text)
