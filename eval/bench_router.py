"""Many replicas behind one router, two comparisons in one run (issue 16), each on fresh
replicas of one model, the same seeded requests at the same Poisson rates:

    python -m slimserve.eval.bench_router --model recipes/demo-model --threads-per-replica 1 \
        --json-out router.json

1. `skewed` (routing policies): `--policies` (least-latency, round-robin) over `--replicas` (2)
   colocated replicas. Prompts are windows of Python's own source text; a fifth are
   `--long-factor` (8) times longer; half start with the same system prompt (a shared prefix
   the replicas' prefix caches can reuse). Every request streams `--max-tokens` tokens. Measured
   near saturation: below it every policy finishes the same work in the same time, and only
   latency can differ. `--rate auto` (the default) first measures the replica set's capacity
   (`--probe-requests` of the workload sent at once to fresh round-robin replicas: completed
   requests/s) and runs every policy at `--load` times it, so the comparison sits near
   saturation on any machine; a number fixes the rate instead. At 1.0 the arrivals, not the
   replicas, set the throughput (every policy completes the same requests over the same span,
   within 0.1%), so the default `--load` is 1.25: the queues grow during the run, throughput is
   what the replica set completes, and a policy that leaves one replica idle while the other has
   a backlog shows it in both P99 TTFT and throughput.
2. `interference` (prefill/decode disaggregation): a stream of short, decode-heavy requests
   (`--short-chars` prompts, `--short-tokens` outputs, `--short-rate`) while long prompts
   (`--long-chars`, `--long-tokens`, `--long-rate`) arrive, served by `colocated` (two colocated
   replicas, least-latency) and by `disaggregated` (one `--role prefill` and one `--role decode`
   replica): the same total cores. A long prompt's prefill chunks stall every decode on its
   engine; disaggregated, the decode replica never prefills.

`--repeat N` measures every configuration N times, alternating them (run 1 of each, then run 2
of each, ...), so a slow spell of the machine hits both sides of a comparison; the verdicts take
the median of the runs and count the runs each side won. One run's P99 of 400 requests is its
4th-worst request and moves by +-20% between identical runs on the 2-core machine.

Each configuration gets fresh replicas (`runtime serve` processes, `--threads-per-replica` threads
each) and the router (`runtime router`, its own process). After an untimed warm-up the prefix
caches are reset (POST /reset_prefix_cache through the router), then the run is measured.
Reported per configuration: TTFT and TPOT (mean, median, P99; vLLM's definition: (E2E - TTFT) /
(output tokens - 1)), end-to-end P99, request and output-token throughput, requests per replica;
for `interference` also TPOT and TTFT of the short requests alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slimserve.runtime.bench.driver import run_requests
from slimserve.runtime.bench.workload import BenchRequest, RequestResult, latency_stats
from slimserve.runtime.server.process import ServerSpec, free_port, launched_servers
from slimserve.runtime.server.trust import INTERNAL_KEY_ENV, internal_headers, new_internal_key

SYSTEM = (
    "You are a meticulous senior Python reviewer. Read the code below, explain what it "
    "does, point out every bug, and suggest a minimal fix. Answer in plain text. "
) * 6
# configuration -> (role of each replica, router policy)
INTERFERENCE = {
    "colocated": (["colocated", "colocated"], "least-latency"),
    "disaggregated": (["prefill", "decode"], "least-latency"),
}


def _source_text() -> str:
    import argparse as a
    import inspect
    import json as j
    import logging

    return "".join(inspect.getsource(m) for m in (a, j, logging))


def skewed_workload(
    n: int, short_chars: int, long_factor: int, max_tokens: int, rate: float, seed: int
) -> list[dict]:
    """Requests {prompt, max_tokens, at, kind}: a fifth long, half with the system prompt."""
    rng = random.Random(seed)
    text = _source_text()
    out, at = [], 0.0
    for _ in range(n):
        long = rng.random() < 0.2
        size = short_chars * (long_factor if long else 1)
        start = rng.randrange(0, len(text) - size)
        body = text[start : start + size]
        prompt = SYSTEM + body if rng.random() < 0.5 else body
        out.append(
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "at": at,
                "kind": "long" if long else "short",
            }
        )
        at += rng.expovariate(rate)
    return out


def interference_workload(args: argparse.Namespace) -> list[dict]:
    """Short decode-heavy requests at --short-rate and long prompts at --long-rate, merged by
    arrival time (two seeded Poisson streams over the same span)."""
    rng = random.Random(args.seed + 7)
    text = _source_text()
    reqs = []
    for kind, n, rate, chars, tokens in (
        ("short", args.num_short, args.short_rate, args.short_chars, args.short_tokens),
        ("long", args.num_long, args.long_rate, args.long_chars, args.long_tokens),
    ):
        at = rng.expovariate(rate) if kind == "long" else 0.0  # a long one never leads
        for _ in range(n):
            start = rng.randrange(0, len(text) - chars)
            reqs.append(
                {
                    "prompt": text[start : start + chars],
                    "max_tokens": tokens,
                    "at": at,
                    "kind": kind,
                }
            )
            at += rng.expovariate(rate)
    return sorted(reqs, key=lambda r: r["at"])


def _ms(values: list[float]) -> dict | None:
    return latency_stats(values)  # mean, median, p99 in ms (numpy percentiles, as vLLM)


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    out = {
        "requests": len(results),
        "completed": len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / duration,
        "ttft_ms": _ms([r["ttft_s"] for r in ok]),
        "tpot_ms": _ms([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "e2e_ms": _ms([r["e2e_s"] for r in ok]),
    }
    for kind in ("short", "long"):
        mine = [r for r in ok if r["kind"] == kind]
        out[kind] = {
            "completed": len(mine),
            "ttft_ms": _ms([r["ttft_s"] for r in mine]),
            "tpot_ms": _ms([r["tpot_s"] for r in mine if r["tpot_s"] is not None]),
        }
    return out


def _row(kind: str, res: RequestResult) -> dict:
    """What summarize reads of one request (the serving benchmark's client measured it)."""
    return {
        "kind": kind,
        "ttft_s": res.ttft_s if res.success else None,
        "tpot_s": res.tpot_s if res.success else None,
        "e2e_s": res.latency_s,
        "tokens": res.output_tokens,
        "error": res.error or None,
    }


async def run_load(url: str, model: str, requests: list[dict]) -> dict:
    """Each request streamed at its arrival time by `runtime bench`'s client (text prompts)."""
    reqs = [BenchRequest([], r["prompt"], r["max_tokens"]) for r in requests]
    results, duration = await run_requests(
        url, model, reqs, [r["at"] for r in requests], text_prompts=True
    )
    return summarize([_row(r["kind"], res) for r, res in zip(requests, results)], duration)


def probe_capacity(args: argparse.Namespace, logs: Path) -> float:
    """Requests/s the colocated set completes with the skewed workload sent all at once."""
    reqs = skewed_workload(
        args.probe_requests,
        args.skew_short_chars,
        args.long_factor,
        args.max_tokens,
        1.0,
        args.seed + 1,
    )
    for r in reqs:
        r["at"] = 0.0
    r = run_config("probe", ["colocated"] * args.replicas, "round-robin", reqs, args, logs)
    return r["request_throughput"]


def run_config(
    name: str,
    roles: list[str],
    policy: str,
    requests: list[dict],
    args: argparse.Namespace,
    logs: Path,
) -> dict:
    key = new_internal_key()  # the deployment's: hand-overs and the prefix-cache reset need it
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads_per_replica),
        "MKL_NUM_THREADS": str(args.threads_per_replica),
        INTERNAL_KEY_ENV: key,
    }
    replicas = []
    for i, role in enumerate(roles):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "slimserve.runtime.cli",
            "serve",
            args.model,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--kv-cache-memory",
            args.kv_cache_memory,
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--role",
            role,
        ]
        replicas.append(
            ServerSpec(cmd, f"http://127.0.0.1:{port}", env, logs / f"{name}-replica{i}-{role}.log")
        )
    port = free_port()
    router_cmd = [
        sys.executable,
        "-m",
        "slimserve.runtime.cli",
        "router",
        "--policy",
        policy,
        "--port",
        str(port),
        *[a for r in replicas for a in ("--replica", r.url)],
    ]
    router = ServerSpec(
        router_cmd,
        f"http://127.0.0.1:{port}",
        {**os.environ, "OMP_NUM_THREADS": "1", INTERNAL_KEY_ENV: key},
        logs / f"{name}-router.log",
    )
    with launched_servers(replicas, 600), launched_servers([router], 300):
        model = httpx.get(router.url + "/v1/models", trust_env=False).json()["data"][0]["id"]
        deadline = time.monotonic() + 30  # the router knows every replica's role
        while time.monotonic() < deadline:
            listed = httpx.get(router.url + "/router/replicas", trust_env=False).json()["replicas"]
            if sorted(r["role"] for r in listed if r["up"]) == sorted(roles):
                break
            time.sleep(0.2)
        for r in requests[: 2 * len(roles)]:  # warm-up, untimed
            httpx.post(
                router.url + "/v1/completions",
                json={"model": model, "prompt": r["prompt"], "max_tokens": 4},
                timeout=300,
                trust_env=False,
            )
        reset = httpx.post(
            router.url + "/reset_prefix_cache",
            headers=internal_headers(key),
            timeout=60,
            trust_env=False,
        )
        result = asyncio.run(run_load(router.url, model, requests))
        state = httpx.get(router.url + "/router/replicas", trust_env=False).json()
        result["served_per_replica"] = {
            f"{r['role']}@{r['url'].rsplit(':', 1)[1]}": r["dispatched"] for r in state["replicas"]
        }
        result["prefix_cache_reset"] = reset.status_code == 200
    result["config"], result["policy"], result["roles"] = name, policy, roles
    return result


def _line(r: dict) -> str:
    def p(d, key):
        return f"{d[key]:8.1f}" if d else "     n/a"

    return (
        f"{r['config']:>14}: TTFT p50 {p(r['ttft_ms'], 'median')} p99 {p(r['ttft_ms'], 'p99')} ms"
        f" | TPOT p50 {p(r['tpot_ms'], 'median')} p99 {p(r['tpot_ms'], 'p99')} ms"
        f" | {r['request_throughput']:5.2f} req/s {r['output_tokens_per_s']:7.1f} tok/s"
        f" | done {r['completed']}/{r['requests']} | per replica {r['served_per_replica']}"
    )


def _compare(
    label: str,
    name_a: str,
    runs_a: list[dict],
    name_b: str,
    runs_b: list[dict],
    value,
    lower_wins: bool,
    fmt: str,
) -> str:
    """`label` of a against b over paired runs: the values, their medians, who wins each."""
    pairs = [(value(a), value(b)) for a, b in zip(runs_a, runs_b)]
    a_wins = sum((x < y) if lower_wins else (x > y) for x, y in pairs)
    ma, mb = statistics.median([x for x, _ in pairs]), statistics.median([y for _, y in pairs])
    winner = name_a if ((ma < mb) if lower_wins else (ma > mb)) else name_b
    text = f"{label} {name_a} {ma:{fmt}} vs {name_b} {mb:{fmt}} -> {winner} wins"
    if len(pairs) > 1:
        each = " / ".join(f"{x:{fmt}} vs {y:{fmt}}" for x, y in pairs)
        text += f" (medians of {len(pairs)} runs: {each}; {name_a} won {a_wins} of {len(pairs)})"
    return text


def verdicts(results: dict[str, list[dict]]) -> list[str]:
    """One line per comparison the issue asks for, with who wins (medians over repeated runs)."""
    lines = []
    ll, rr = results.get("least-latency"), results.get("round-robin")
    if ll and rr and all(r["ttft_ms"] for r in ll + rr):
        lines.append(
            "skewed: "
            + _compare(
                "P99 TTFT",
                "least-latency",
                ll,
                "round-robin",
                rr,
                lambda r: r["ttft_ms"]["p99"],
                True,
                ".0f",
            )
            + "; "
            + _compare(
                "throughput",
                "least-latency",
                ll,
                "round-robin",
                rr,
                lambda r: r["output_tokens_per_s"],
                False,
                ".1f",
            )
        )
    co, dis = results.get("colocated"), results.get("disaggregated")
    if co and dis and all(r["tpot_ms"] for r in co + dis):
        short = [(r["short"]["tpot_ms"] or {}).get("p99", float("nan")) for r in dis + co]
        lines.append(
            "interference: "
            + _compare(
                "P99 TPOT",
                "disaggregated",
                dis,
                "colocated",
                co,
                lambda r: r["tpot_ms"]["p99"],
                True,
                ".1f",
            )
            + f" (short requests' P99 TPOT: {statistics.median(short[: len(dis)]):.1f} vs "
            f"{statistics.median(short[len(dis) :]):.1f} ms)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="recipes/demo-model")
    ap.add_argument("--workload", choices=("all", "skewed", "interference"), default="all")
    ap.add_argument("--replicas", type=int, default=2, help="skewed: colocated replicas")
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="128MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every configuration, alternating them; verdicts compare medians",
    )
    g = ap.add_argument_group("skewed")
    g.add_argument("--policies", default="least-latency,round-robin")
    g.add_argument("--num-requests", type=int, default=400)
    g.add_argument(
        "--rate",
        default="auto",
        help="requests/s (Poisson), or auto: --load x the capacity measured first",
    )
    g.add_argument(
        "--load",
        type=float,
        default=1.25,
        help="with --rate auto: the multiple of "
        "the measured capacity to send (above 1 the replicas stay busy to the end, so "
        "throughput is what they complete, not what arrives)",
    )
    g.add_argument("--probe-requests", type=int, default=48)
    g.add_argument(
        "--skew-short-chars",
        type=int,
        default=220,
        help="characters of a short "
        "prompt (x the long factor, plus the system prompt, stays inside the demo "
        "model's 1,024-token context)",
    )
    g.add_argument("--long-factor", type=int, default=8)
    g.add_argument("--max-tokens", type=int, default=32)
    g = ap.add_argument_group("interference")
    g.add_argument("--configs", default="colocated,disaggregated")
    g.add_argument("--num-short", type=int, default=160)
    g.add_argument("--short-rate", type=float, default=4.0)
    g.add_argument("--short-chars", type=int, default=200)
    g.add_argument("--short-tokens", type=int, default=32)
    g.add_argument("--num-long", type=int, default=40)
    g.add_argument("--long-rate", type=float, default=1.0)
    g.add_argument(
        "--long-chars",
        type=int,
        default=2800,
        help="characters of a long prompt (code tokenizes to up to ~2.7 characters a token: inside the demo model's 1,024-token context)",
    )
    g.add_argument("--long-tokens", type=int, default=4)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_router_") as tmp:
        if args.workload in ("all", "skewed"):
            if args.rate == "auto":
                capacity = probe_capacity(args, Path(tmp))
                args.rate = round(args.load * capacity, 2)
                print(
                    f"capacity {capacity:.2f} req/s all at once; measuring at {args.rate} req/s",
                    flush=True,
                )
            args.rate = float(args.rate)
            reqs = skewed_workload(
                args.num_requests,
                args.skew_short_chars,
                args.long_factor,
                args.max_tokens,
                args.rate,
                args.seed,
            )
            for _ in range(args.repeat):
                for policy in args.policies.split(","):
                    r = run_config(
                        policy, ["colocated"] * args.replicas, policy, reqs, args, Path(tmp)
                    )
                    r["workload"], r["load_avg_1m"] = "skewed", os.getloadavg()[0]
                    runs.setdefault(policy, []).append(r)
                    print(_line(r), flush=True)
        if args.workload in ("all", "interference"):
            reqs = interference_workload(args)
            for _ in range(args.repeat):
                for name in args.configs.split(","):
                    roles, policy = INTERFERENCE[name]
                    r = run_config(name, roles, policy, reqs, args, Path(tmp))
                    r["workload"], r["load_avg_1m"] = "interference", os.getloadavg()[0]
                    runs.setdefault(name, []).append(r)
                    print(_line(r), flush=True)
    load.append(os.getloadavg()[0])
    lines = verdicts(runs)
    for line in lines:
        print(line)
    print(f"load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {"config": vars(args), "load_avg_1m": load, "verdicts": lines, "results": runs},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
