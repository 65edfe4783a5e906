"""Routing policies compared on one skewed workload: the same requests, at the same Poisson rate,
through `runtime router` in front of fresh replicas of one model, once per policy.

    python -m slimserve.eval.bench_router --model recipes/demo-model --replicas 2 \
        --threads-per-replica 1 --num-requests 120 --rate 4 --json-out router.json

Workload (seeded): prompts are windows of Python's own source text; a fifth are `--long-factor`
(8) times longer than the rest; half start with the same system prompt (a shared prefix the
replicas' prefix caches can reuse). Every request streams `--max-tokens` tokens (greedy,
ignore_eos). Each policy gets fresh replicas (empty prefix caches), started before and stopped
after its run; the router runs as its own process (`runtime router`). Reported per policy:
TTFT p50/p99, end-to-end p99, output tokens/s, and how many requests each replica served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slimserve.runtime.bench.server_process import ServerSpec, free_port, launched_servers

SYSTEM = ("You are a meticulous senior Python reviewer. Read the code below, explain what it "
          "does, point out every bug, and suggest a minimal fix. Answer in plain text. ") * 6


def _source_text() -> str:
    import argparse as a
    import inspect
    import json as j
    import logging

    return "".join(inspect.getsource(m) for m in (a, j, logging))


def build_workload(n: int, short_chars: int, long_factor: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    text = _source_text()
    prompts = []
    for i in range(n):
        size = short_chars * (long_factor if rng.random() < 0.2 else 1)
        start = rng.randrange(0, len(text) - size)
        body = text[start: start + size]
        prompts.append(SYSTEM + body if rng.random() < 0.5 else body)
    return prompts


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
               at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    sent = time.monotonic()
    ttft, tokens, error = None, 0, None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        break
                    if event["choices"] and event["choices"][0].get("text"):
                        ttft = ttft if ttft is not None else time.monotonic() - sent
                        tokens += 1
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"ttft_s": ttft, "e2e_s": time.monotonic() - sent, "tokens": tokens, "error": error}


async def run_load(url: str, model: str, prompts: list[str], max_tokens: int, rate: float,
                   seed: int) -> dict:
    rng = random.Random(seed + 1)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits,
                                 trust_env=False) as client:
        t0 = time.monotonic()
        results = await asyncio.gather(*(_one(client, url, model, p, max_tokens, at, t0)
                                         for p, at in zip(prompts, arrivals)))
        duration = time.monotonic() - t0
    ok = [r for r in results if r["error"] is None and r["ttft_s"] is not None]
    ttft = [r["ttft_s"] for r in ok]
    return {"requests": len(results), "completed": len(ok),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5],
            "duration_s": duration, "output_tokens_per_s": sum(r["tokens"] for r in ok) / duration,
            "ttft_ms": {"p50": 1e3 * (_pct(ttft, 50) or 0), "p99": 1e3 * (_pct(ttft, 99) or 0),
                        "mean": 1e3 * sum(ttft) / max(1, len(ttft))},
            "e2e_ms_p99": 1e3 * (_pct([r["e2e_s"] for r in ok], 99) or 0)}


def run_policy(policy: str, args: argparse.Namespace, prompts: list[str], logs: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_replica),
           "MKL_NUM_THREADS": str(args.threads_per_replica)}
    replicas = []
    for i in range(args.replicas):
        port = free_port()
        cmd = [sys.executable, "-m", "slimserve.runtime.cli", "serve", args.model, "--port",
               str(port), "--device", "cpu", "--kv-cache-memory", args.kv_cache_memory,
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        replicas.append(ServerSpec(cmd, f"http://127.0.0.1:{port}", env,
                                   logs / f"{policy}-replica{i}.log"))
    port = free_port()
    router_cmd = [sys.executable, "-m", "slimserve.runtime.cli", "router", "--policy", policy,
                  "--port", str(port), *[a for r in replicas for a in ("--replica", r.url)]]
    router = ServerSpec(router_cmd, f"http://127.0.0.1:{port}", {**os.environ,
                                                                 "OMP_NUM_THREADS": "1"},
                        logs / f"{policy}-router.log")
    with launched_servers(replicas, 600), launched_servers([router], 60):
        model = httpx.get(router.url + "/v1/models", trust_env=False).json()["data"][0]["id"]
        for p in prompts[:2]:  # warm-up, untimed
            httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": p,
                       "max_tokens": 2}, timeout=120, trust_env=False)
        result = asyncio.run(run_load(router.url, model, prompts, args.max_tokens, args.rate,
                                      args.seed))
        state = httpx.get(router.url + "/router/replicas", trust_env=False).json()
        result["served_per_replica"] = [r["dispatched"] for r in state["replicas"]]
    result["policy"] = policy
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="recipes/demo-model")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads-per-replica", type=int, default=1)
    ap.add_argument("--policies", default="least-latency,round-robin")
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    ap.add_argument("--short-chars", type=int, default=250, help="characters of a short prompt "
                    "(x the long factor stays inside the demo model's 1,024-token context)")
    ap.add_argument("--long-factor", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="128MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    prompts = build_workload(args.num_requests, args.short_chars, args.long_factor, args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_router_") as tmp:
        for policy in args.policies.split(","):
            r = run_policy(policy, args, prompts, Path(tmp))
            results.append(r)
            print(f"{policy:>14}: TTFT p50 {r['ttft_ms']['p50']:8.1f} ms  p99 "
                  f"{r['ttft_ms']['p99']:8.1f} ms  e2e p99 {r['e2e_ms_p99']:8.1f} ms  "
                  f"{r['output_tokens_per_s']:7.1f} tok/s  completed {r['completed']}/"
                  f"{r['requests']}  per replica {r['served_per_replica']}", flush=True)
            if r["errors"]:
                print(f"{'':>14}  errors: {r['errors']}", flush=True)
    out = {"config": vars(args), "results": results}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
