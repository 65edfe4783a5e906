"""Server reliability under hostile clients: what a stalled stream holds, and how long /health
takes while a request with a long stop list is being served.

    python -m slimserve.eval.bench_server_reliability [--model recipes/demo-model] [--runs 3]

1. **Stalled stream.** A streamed `/v1/completions` request (n=8, max_tokens=700, ignore_eos,
   greedy) whose client reads the first chunk and then nothing more, driven in-process through
   the ASGI interface (the `send` of the stalled client never returns, as when the TCP window is
   full). Once the engine has finished all eight choices, `tracemalloc` gives the bytes the server
   still holds for that one request (above the idle baseline), and its peak. Output held as
   cumulative copies grows as O(T^2) per choice; as deltas, O(T).
2. **/health under stop strings.** A live uvicorn server on 127.0.0.1 streams one request with
   64 stop strings of N characters that never match (max_tokens=400) while a second thread
   polls `/health` every 20 ms; the table gives the worst and median /health latency, and the
   same with no stop strings as the reference. A refused request (stop strings beyond the limit)
   is reported as such.

Only the public server interface is used (EngineConfig, AsyncEngine, build_app), so the same
file measures an older checkout: put that checkout's packages first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import random
import socket
import statistics
import string
import threading
import time
import tracemalloc
from pathlib import Path

import uvicorn

from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.server.app import build_app

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "recipes" / "demo-model"


# -- 1. stalled stream -------------------------------------------------------------------------


async def _stalled_stream(
    engine: AsyncEngine, n: int, max_tokens: int, logprobs: int | None, settle_s: float = 1.0
) -> dict:
    app = build_app(engine)
    await engine.start()
    body = {
        "prompt": "def main():",
        "max_tokens": max_tokens,
        "n": n,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ],
    }
    never = asyncio.Event()  # the client neither disconnects nor reads
    sent_body = asyncio.Event()
    received = []

    async def receive():
        if not received:
            received.append(1)
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            if sent_body.is_set():
                await never.wait()  # the stalled reader: this send never completes
            sent_body.set()

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    task = asyncio.ensure_future(app(scope, receive, send))
    t0 = time.monotonic()
    while not sent_body.is_set():
        await asyncio.sleep(0.01)
    # every choice had its first output before the first chunk was sent; wait for the last
    while engine.engine.requests:
        await asyncio.sleep(0.05)
    gen_s = time.monotonic() - t0
    await asyncio.sleep(settle_s)  # outputs in flight reach their queues
    held, peak = tracemalloc.get_traced_memory()
    alive = not task.done()
    tracemalloc.stop()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    await engine.shutdown()
    return {
        "held_bytes": held - base,
        "peak_bytes": peak - base,
        "generation_s": gen_s,
        "stream_still_open": alive,
    }


# -- 2. /health latency while a stop list is served ----------------------------------------------


def _serve(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, thread, sock.getsockname()[1]


def _health_poller(port: int, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        out.append(time.perf_counter() - t0)
        conn.close()
        time.sleep(0.02)


def _stream(port: int, body: dict) -> tuple[int, int, str]:
    """(status, SSE events received, first error message or '')."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    if resp.status != 200:
        return resp.status, 0, json.loads(data)["error"]["message"]
    return resp.status, data.count("data: "), ""


def _health_under_stops(
    engine: AsyncEngine, stop_count: int, stop_chars: int, max_tokens: int
) -> dict:
    rng = random.Random(0)
    # \x01 never comes out of the demo model's tokenizer, so no stop string matches
    stops = [
        "\x01" + "".join(rng.choices(string.ascii_letters, k=stop_chars - 1))
        for _ in range(stop_count)
    ]
    server, thread, port = _serve(build_app(engine))
    try:
        body = {
            "prompt": "def main():",
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            "ignore_eos": True,
            "stop": stops,
        }
        lat: list[float] = []
        halt = threading.Event()
        poller = threading.Thread(target=_health_poller, args=(port, halt, lat), daemon=True)
        poller.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        status, events, err = _stream(port, body)
        wall = time.monotonic() - t0
        halt.set()
        poller.join(120)
    finally:
        server.should_exit = True
        thread.join(60)
    return {
        "stops": f"{stop_count} x {stop_chars}" if stop_count else "none",
        "status": status,
        "events": events,
        "error": err,
        "request_s": wall,
        "health_polls": len(lat),
        "health_max_ms": 1e3 * max(lat),
        "health_p50_ms": 1e3 * statistics.median(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stop-chars", type=int, nargs="+", default=[4000, 1024])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    config = EngineConfig(model=args.model, device="cpu", dtype="float32", max_num_seqs=16)
    results: dict = {
        "hardware": hardware_line(hardware_info()),
        "model": args.model,
        "stalled": [],
        "health": [],
    }
    print(results["hardware"])
    for logprobs in (None, 5):
        for _ in range(args.runs):
            engine = AsyncEngine.from_config(config)
            r = asyncio.run(_stalled_stream(engine, 8, 700, logprobs))
            r["logprobs"] = logprobs
            results["stalled"].append(r)
            print(
                f"stalled n=8 max_tokens=700 logprobs={logprobs}: held "
                f"{r['held_bytes'] / 2**20:.2f} MiB, peak {r['peak_bytes'] / 2**20:.2f} MiB, "
                f"generation {r['generation_s']:.1f} s, stream open {r['stream_still_open']}",
                flush=True,
            )
    for chars in [0, *args.stop_chars]:
        for _ in range(args.runs):
            engine = AsyncEngine.from_config(config)
            r = _health_under_stops(engine, 64 if chars else 0, chars, 400)
            results["health"].append(r)
            print(
                f"/health with stops {r['stops']}: status {r['status']} "
                f"{r['error'][:80]} request {r['request_s']:.1f} s, /health max "
                f"{r['health_max_ms']:.1f} ms, p50 {r['health_p50_ms']:.1f} ms over "
                f"{r['health_polls']} polls",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
