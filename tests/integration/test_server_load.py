"""The real server + engine on the demo model under load: 200 concurrent streaming requests,
some cancelled midway and some invalid. Every valid request must be answered in full, nothing
may answer 5xx, and the KV cache must be empty afterwards (no leaked blocks)."""

import asyncio
import json
import time

import httpx
import pytest

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.server.app import build_app
from tests.helpers import DEMO_MODEL
from tests.helpers.live_server import serve_in_thread

N_VALID, N_CANCEL, N_INVALID = 160, 24, 16


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(DEMO_MODEL), max_num_seqs=64, max_num_batched_tokens=512)
    )
    with serve_in_thread(build_app(engine), start_timeout=60) as url:
        yield url, engine


async def _stream(client, body, cancel_after=None):
    """(status, chunks text, finish_reason, completion tokens) of one streamed completion."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", None, 0
        text, finish, usage, n = "", None, 0, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                text += c["text"]
                finish = c["finish_reason"] or finish
                n += 1
            if cancel_after is not None and n >= cancel_after:
                return 200, text, "cancelled", usage  # leaving the block closes the connection
        return 200, text, finish, usage


def test_200_concurrent_streams_with_cancels_and_invalid_requests(server):
    url, engine = server
    prompts = ["def f(x):\n", "import os\n", "class A:\n", "for i in range(3):\n", "# comment\n"]

    async def main():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            jobs = []
            for i in range(N_VALID):
                body = {
                    "model": "demo-model",
                    "prompt": prompts[i % 5] * (1 + i % 7),
                    "max_tokens": 4 + i % 13,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                jobs.append(("valid", body["max_tokens"], _stream(client, body)))
            for i in range(N_CANCEL):
                body = {
                    "model": "demo-model",
                    "prompt": prompts[i % 5],
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "stream": True,
                }
                jobs.append(("cancel", 0, _stream(client, body, cancel_after=2)))
            bad = [
                {"prompt": "x", "max_tokens": -1},
                {"prompt": "x", "temperature": -1},
                {"prompt": "", "max_tokens": 5},
                {"prompt": "x", "top_p": 0},
                {"prompt": "x " * 5000},
                {"prompt": "x", "model": "nope"},
                {"prompt": "x", "max_tokens": "many"},
                {"prompt": "x", "max_tokens": 10**9},
            ]
            for i in range(N_INVALID):
                body = {"model": "demo-model", "stream": True, **bad[i % len(bad)]}
                jobs.append(("invalid", 0, _stream(client, body)))
            results = await asyncio.gather(*(j[2] for j in jobs))
            return [(kind, want, res) for (kind, want, _), res in zip(jobs, results)]

    results = asyncio.run(main())
    for kind, want, (status, _text, finish, usage) in results:
        assert status < 500, (kind, status)
        if kind == "valid":
            assert status == 200 and finish == "length" and usage == want, (
                want,
                status,
                finish,
                usage,
            )
        elif kind == "invalid":
            assert status in (400, 404, 422), status
        else:
            assert status == 200 and finish == "cancelled"
    deadline = time.monotonic() + 30  # aborts reach the engine thread asynchronously
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
            break
        time.sleep(0.1)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'finished_reason="abort"' in metrics
    assert "slimserve:kv_cache_usage_perc 0.0" in metrics
