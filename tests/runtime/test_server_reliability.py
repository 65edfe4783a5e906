"""The server under hostile or unlucky clients, with the fake engine: a stalled stream reader is
dropped and its request aborted, a body that never arrives gets 408, a burst cannot overshoot
--max-queue, oversized prompts are refused before tokenizing, tokenizing runs off the event loop,
a request the engine fails alone gets a 5xx while the server goes on, /health turns 503 for a
stuck or dead engine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from slimserve.runtime.server.app import build_app
from slimserve.runtime.server.http import ClosingStreamingResponse
from slimserve.runtime.server.responses import DONE
from tests.helpers.asgi import call
from tests.helpers.server_fakes import FakeEngine, events

pytestmark = pytest.mark.timeout(60)


def test_a_stream_whose_client_stops_reading_is_dropped_and_aborted():
    engine = FakeEngine(delay=0.001, max_model_len=4000)
    app = build_app(engine, stream_timeout_s=0.3)

    async def run():
        t0 = time.monotonic()
        reply = await asyncio.wait_for(
            call(
                app,
                "/v1/completions",
                {"prompt": "hi", "max_tokens": 3000, "stream": True},
                read_chunks=2,
            ),
            20,
        )
        return reply, time.monotonic() - t0

    reply, took = asyncio.run(run())
    assert reply.status == 200 and len(reply.chunks) == 2 and not reply.complete
    assert took < 10  # dropped after the 0.3 s timeout, not after the whole generation
    assert engine.abort_calls and engine.closed_early  # the engine request ended, blocks freed


def test_closing_streaming_response_times_out_a_blocked_send_and_closes_its_body():
    closed = []

    async def body():
        try:
            for i in range(100):
                yield f"chunk {i}"
        finally:
            closed.append(True)

    async def run():
        forever = asyncio.Event()
        sent = []

        async def send(message):
            if len(sent) >= 2:  # the start and one chunk went out; then the client stalls
                await forever.wait()
            sent.append(message)

        async def receive():
            await forever.wait()

        resp = ClosingStreamingResponse(body(), send_timeout=0.2)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await asyncio.wait_for(resp(scope, receive, send), 5)
        return sent

    sent = asyncio.run(run())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert closed == [True]


def test_a_body_that_never_arrives_gets_408():
    app = build_app(FakeEngine(), body_timeout_s=0.2)
    reply = asyncio.run(
        asyncio.wait_for(call(app, "/v1/completions", {"prompt": "hi"}, send_body=False), 10)
    )
    assert reply.status == 408
    assert "not received within 0.2 s" in reply.json()["error"]["message"]


def test_a_burst_cannot_overshoot_max_queue():
    """20 requests at once with --max-queue 3: the check and the count have no await between
    them, so exactly 3 are admitted while none has its first token yet."""
    engine = FakeEngine(delay=0.5)
    app = build_app(engine, max_queue=3)

    async def run():
        body = {"prompt": "hi", "max_tokens": 1}
        return await asyncio.gather(*(call(app, "/v1/completions", body) for _ in range(20)))

    replies = asyncio.run(run())
    statuses = sorted(r.status for r in replies)
    assert statuses.count(200) == 3 and statuses.count(503) == 17, statuses
    assert all(r.json()["error"]["code"] == "queue_full" for r in replies if r.status == 503)


def test_an_oversized_prompt_is_refused_before_tokenizing(monkeypatch):
    engine = FakeEngine(max_model_len=64)
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or [1])
    monkeypatch.setattr(
        engine.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or "x"
    )
    with TestClient(build_app(engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 100_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "100000 characters" in r.json()["error"]["message"]
        r = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 100_000}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = c.post("/v1/completions", json={"prompt": list(range(1, 70)), "echo": True})
        assert r.status_code == 400 and "69 tokens" in r.json()["error"]["message"]
    assert calls == []


def test_chat_rendering_and_echo_decoding_run_off_the_event_loop(monkeypatch):
    engine = FakeEngine()
    threads = []
    render, decode = engine.tokenizer.apply_chat_template, engine.tokenizer.decode

    def spy_render(*a, **k):
        threads.append(("render", threading.current_thread()))
        return render(*a, **k)

    def spy_decode(ids):
        threads.append(("decode", threading.current_thread()))
        return decode(ids)

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", spy_render)
    with TestClient(build_app(engine)) as c:
        loop_thread = c.portal.call(lambda: threading.current_thread())
        assert (
            c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            ).status_code
            == 200
        )
        # (the fake engine decodes its own output on the loop; the echo decode comes first)
        monkeypatch.setattr(engine.tokenizer, "decode", spy_decode)
        assert (
            c.post(
                "/v1/completions", json={"prompt": [104, 105], "echo": True, "max_tokens": 1}
            ).status_code
            == 200
        )
    assert [k for k, _ in threads][:2] == ["render", "decode"]
    assert threads[0][1] is not loop_thread and threads[1][1] is not loop_thread


def test_a_request_the_engine_fails_alone_gets_an_error_and_the_server_goes_on():
    engine = FakeEngine()
    engine.fail_request_after = 2
    with TestClient(build_app(engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "request_failed"
        assert "logits are NaN" in r.json()["error"]["message"]
        ev = events(
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream": True}).text
        )
        assert ev[-1] == DONE.strip()[len("data: ") :]
        assert ev[-2]["error"]["code"] == "request_failed"
        engine.fail_request_after = None
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
        assert c.get("/health").status_code == 200
        assert 'finished_reason="error"' in c.get("/metrics").text


def test_health_is_503_while_the_engine_is_stuck_or_dead():
    engine = FakeEngine()
    with TestClient(build_app(engine)) as c:
        assert c.get("/health").status_code == 200
        engine.unhealthy = "an engine step has run for 301 s (watchdog 300 s)"
        r = c.get("/health")
        assert r.status_code == 503 and "watchdog" in r.json()["error"]["message"]
        engine.unhealthy = None
        engine.dead = True
        assert c.get("/health").status_code == 503
