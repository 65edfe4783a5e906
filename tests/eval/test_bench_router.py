"""eval/bench_router.py: the two workloads it compares on (seeded, shaped as the issue asks),
the per-configuration summary (TTFT, TPOT as vLLM defines it, per kind) and the verdict lines.
The run itself starts replicas; it is the benchmark (docs/results-serving.md), not a default-suite test."""

from __future__ import annotations

import argparse

import pytest

from slimserve.eval.bench_router import (
    SYSTEM,
    interference_workload,
    skewed_workload,
    summarize,
    verdicts,
)


def test_skewed_workload_shape():
    reqs = skewed_workload(400, 250, 8, 32, rate=10.0, seed=0)
    assert reqs == skewed_workload(400, 250, 8, 32, rate=10.0, seed=0)  # seeded
    long = [r for r in reqs if r["kind"] == "long"]
    assert 0.15 < len(long) / len(reqs) < 0.25
    assert all(len(r["prompt"].removeprefix(SYSTEM)) == 2000 for r in long)
    assert 0.4 < sum(r["prompt"].startswith(SYSTEM) for r in reqs) / len(reqs) < 0.6
    ats = [r["at"] for r in reqs]
    assert ats == sorted(ats) and ats[0] == 0.0
    assert 400 / ats[-1] == pytest.approx(10.0, rel=0.15)  # Poisson at the asked rate
    assert {r["max_tokens"] for r in reqs} == {32}


def test_interference_workload_shape():
    args = argparse.Namespace(
        seed=0,
        num_short=50,
        short_rate=2.0,
        short_chars=200,
        short_tokens=32,
        num_long=10,
        long_rate=0.5,
        long_chars=3200,
        long_tokens=4,
    )
    reqs = interference_workload(args)
    assert [r["at"] for r in reqs] == sorted(r["at"] for r in reqs)
    short = [r for r in reqs if r["kind"] == "short"]
    long = [r for r in reqs if r["kind"] == "long"]
    assert len(short) == 50 and len(long) == 10 and reqs[0]["kind"] == "short"
    assert {len(r["prompt"]) for r in short} == {200} and {r["max_tokens"] for r in short} == {32}
    assert {len(r["prompt"]) for r in long} == {3200} and {r["max_tokens"] for r in long} == {4}


def _res(kind, ttft, e2e, tokens, error=None):
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else None
    return {
        "kind": kind,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "tokens": tokens,
        "error": error,
    }


def test_summary_and_verdicts():
    results = [
        _res("short", 0.1, 3.2, 32),
        _res("short", 0.2, 1.75, 32),
        _res("long", 1.0, 1.3, 4),
        _res("short", None, 5.0, 0, error="HTTP 502: x"),
    ]
    s = summarize(results, duration=10.0)
    assert s["completed"] == 3 and s["errors"] == ["HTTP 502: x"]
    assert s["output_tokens_per_s"] == pytest.approx(6.8)
    assert s["short"]["tpot_ms"]["median"] == pytest.approx(75.0)  # (0.1 s, 0.05 s) per token
    assert s["long"]["tpot_ms"]["p99"] == pytest.approx(100.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(984.0)
    fast = dict(s, config="disaggregated", tpot_ms={"p99": 50.0, "median": 40.0})
    slow = dict(s, config="colocated", tpot_ms={"p99": 90.0, "median": 45.0})
    ll = dict(s, ttft_ms={"p99": 300.0}, output_tokens_per_s=100.0)
    rr = dict(s, ttft_ms={"p99": 400.0}, output_tokens_per_s=90.0)
    lines = verdicts(
        {"disaggregated": [fast], "colocated": [slow], "least-latency": [ll], "round-robin": [rr]}
    )
    assert lines[0].startswith(
        "skewed: P99 TTFT least-latency 300 vs round-robin 400 -> "
        "least-latency wins; throughput least-latency 100.0 vs "
        "round-robin 90.0 -> least-latency wins"
    )
    assert "P99 TPOT disaggregated 50.0 vs colocated 90.0 -> disaggregated wins" in lines[1]
    assert "colocated wins" in verdicts({"disaggregated": [slow], "colocated": [fast]})[0]


def test_repeated_runs_compare_medians_and_count_wins():
    def run(p99, tok_s):
        return {"ttft_ms": {"p99": p99}, "output_tokens_per_s": tok_s}

    ll = [run(900.0, 200.0), run(700.0, 201.0), run(800.0, 199.0)]
    rr = [run(800.0, 199.0), run(950.0, 200.0), run(850.0, 198.0)]
    line = verdicts({"least-latency": ll, "round-robin": rr})[0]
    # medians 800 vs 850: least-latency wins although it lost the first pair
    assert "P99 TTFT least-latency 800 vs round-robin 850 -> least-latency wins" in line
    assert "900 vs 800 / 700 vs 950 / 800 vs 850; least-latency won 2 of 3" in line
    assert "throughput least-latency 200.0 vs round-robin 199.0 -> least-latency wins" in line
