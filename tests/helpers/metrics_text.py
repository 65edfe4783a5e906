"""Prometheus text a server's /metrics could answer, built from the numbers a test cares about,
for the bench breakdown parsers (runtime/bench/breakdown.py)."""

from __future__ import annotations


def step_metrics(
    steps: int,
    phase_seconds: dict[str, float],
    *,
    prefill_tokens: float | None = None,
    decode_rows: float | None = None,
    collectives: dict[str, tuple[float, float]] | None = None,
) -> str:
    """`steps` steps with `phase_seconds[phase]` seconds in each phase (in step order); the
    prefill-token and decode-row histograms' sums when given; `collectives[rank] = (seconds, calls)`
    as the tensor-parallel counters."""
    lines = ["# TYPE slimserve:step_phase_seconds histogram"]
    for phase, seconds in phase_seconds.items():
        lines += [
            f'slimserve:step_phase_seconds_bucket{{le="+Inf",phase="{phase}"}} {float(steps)}',
            f'slimserve:step_phase_seconds_sum{{phase="{phase}"}} {seconds}',
            f'slimserve:step_phase_seconds_count{{phase="{phase}"}} {float(steps)}',
        ]
    for name, total in (("step_prefill_tokens", prefill_tokens), ("step_decode_rows", decode_rows)):
        if total is not None:
            lines += [
                f"# TYPE slimserve:{name} histogram",
                f'slimserve:{name}_bucket{{le="+Inf"}} {float(steps)}',
                f"slimserve:{name}_sum {total}",
                f"slimserve:{name}_count {float(steps)}",
            ]
    if collectives:
        lines += [
            "# HELP slimserve:tp_collective_seconds_total Time the rank spent in collectives.",
            "# TYPE slimserve:tp_collective_seconds_total counter",
        ]
        lines += [
            f'slimserve:tp_collective_seconds_total{{rank="{r}"}} {s}'
            for r, (s, _) in collectives.items()
        ]
        lines += [
            "# HELP slimserve:tp_collective_calls_total Collectives the rank ran.",
            "# TYPE slimserve:tp_collective_calls_total counter",
        ]
        lines += [
            f'slimserve:tp_collective_calls_total{{rank="{r}"}} {c}'
            for r, (_, c) in collectives.items()
        ]
    lines += ["# TYPE slimserve:num_requests_running gauge", "slimserve:num_requests_running 0.0"]
    return "\n".join(lines) + "\n"
