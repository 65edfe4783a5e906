"""The OpenAI-compatible server on a real uvicorn port (fake engine, tests/helpers/server_fakes.py):
the official `openai` client, client disconnects, and the `runtime serve` command.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from slimserve.runtime.server.app import build_app
from tests.helpers.live_server import serve_in_thread, wait_for
from tests.helpers.server_fakes import FakeEngine, chat_messages

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(delay=0.01)
    with serve_in_thread(build_app(engine, api_key="sk-test")) as url:
        yield engine, url


def test_official_openai_client(live):
    engine, url = live
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
    assert [m.id for m in c.models.list()] == ["fake-model"]
    r = c.completions.create(model="fake-model", prompt="hi", max_tokens=3, seed=2)
    assert r.choices[0].text == "cde" and r.usage.total_tokens == 5
    parts = list(
        c.completions.create(
            model="fake-model",
            prompt="hi",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == "abcd"
    assert parts[-1].usage.completion_tokens == 4
    r = c.chat.completions.create(
        model="fake-model", messages=chat_messages(), max_tokens=2, logprobs=True, top_logprobs=1
    )
    assert r.choices[0].message.content == "ab" and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.content[0].top_logprobs[0].token == "a"
    parts = list(
        c.chat.completions.create(
            model="fake-model", messages=chat_messages(), max_tokens=3, stream=True
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts) == "abc"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="fake-model", prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()


def test_client_disconnect_aborts_the_request(live):
    engine, url = live
    auth = {"Authorization": "Bearer sk-test"}
    with httpx.Client(base_url=url, headers=auth, timeout=10) as c:
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 60, "stream": True}
        ) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line)[len("data: ") :])
        # leaving the block closed the connection mid-stream
        wait_for(lambda: first["id"] in engine.closed_early or first["id"] in engine.abort_calls)
        assert len(engine.requests[-1][1]) == 2 and engine.requests[-1][0] == first["id"]
        n = len(engine.requests)
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request, abandoned while running
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 60}, timeout=0.1)
        wait_for(lambda: len(engine.requests) > n)
        rid = engine.requests[n][0]
        wait_for(lambda: rid in engine.closed_early or rid in engine.abort_calls)


# -- `runtime serve` -----------------------------------------------------------------------------


def test_serve_cli_config_errors_and_startup(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from slimserve.runtime import cli
    from slimserve.runtime.engine.async_engine import AsyncEngine
    from slimserve.runtime.errors import ArtifactError

    run = CliRunner().invoke
    for args, needle in [
        ([str(tmp_path / "missing")], "model:"),
        ([str(tmp_path), "--block-size", "3"], "block_size:"),
        ([str(tmp_path), "--kv-cache-dtype", "int2"], "kv_cache_dtype:"),
        ([str(tmp_path), "--kv-cache-memory", "lots"], "kv_cache_memory:"),
    ]:
        r = run(cli.app, ["serve", *args])
        assert r.exit_code == 2 and needle in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output

    seen = {}

    def from_config(config, **kw):
        seen["config"], seen["engine_kw"] = config, kw
        if config.served_model_name == "broken":
            raise ArtifactError(f"{config.model}/config.json: quant_method 'x' is not supported")
        return FakeEngine()

    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(from_config))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.update(server=self))
    r = run(cli.app, ["serve", str(tmp_path), "--served-model-name", "broken"])
    assert r.exit_code == 2 and "quant_method" in r.output
    r = run(
        cli.app,
        [
            "serve",
            str(tmp_path),
            "--port",
            "9001",
            "--max-num-seqs",
            "3",
            "--max-num-batched-tokens",
            "256",
            "--max-model-len",
            "128",
            "--block-size",
            "32",
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--kv-cache-memory",
            "1GiB",
            "--no-enable-prefix-caching",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--served-model-name",
            "m",
            "--api-key",
            "k",
            "--max-queue",
            "4",
            "--max-connections",
            "7",
            "--body-timeout",
            "5",
            "--stream-timeout",
            "9",
            "--step-watchdog",
            "11",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "1024 tokens" in r.output  # the engine's capacity, from stats()
    assert "64 blocks of 16 tokens (fake)" in r.output  # kv_capacity_line(), printed
    cfg = seen["config"]
    assert (
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        cfg.max_model_len,
        cfg.block_size,
        cfg.kv_cache_dtype,
        cfg.kv_cache_memory,
        cfg.enable_prefix_caching,
        cfg.device,
        cfg.dtype,
        cfg.served_model_name,
        cfg.trust_remote_code,
    ) == (3, 256, 128, 32, "fp8_e4m3", 2**30, False, "cpu", "float32", "m", False)
    server = seen["server"]
    assert (server.config.host, server.config.port) == ("127.0.0.1", 9001)
    serving = server.config.app.state.serving
    assert serving.max_queue == 4
    assert (
        server.config.limit_concurrency,
        serving.body_timeout_s,
        serving.stream_timeout_s,
        seen["engine_kw"],
    ) == (7, 5.0, 9.0, {"step_watchdog_s": 11.0})
    with TestClient(server.config.app) as c:
        assert c.get("/v1/models").status_code == 401


def test_disconnect_aborts_every_choice(live):
    engine, url = live
    auth = {"Authorization": "Bearer sk-test"}
    with httpx.Client(base_url=url, headers=auth, timeout=10) as c:
        with c.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 60, "n": 3, "stream": True},
        ) as r:
            first = json.loads(next(line for line in r.iter_lines() if line)[len("data: ") :])
    rids = [f"{first['id']}-{i}" for i in range(3)]
    wait_for(lambda: all(rid in engine.closed_early or rid in engine.abort_calls for rid in rids))


def test_a_stalled_reader_is_dropped_while_others_are_served():
    """A raw client that never reads its stream (tiny receive buffer) is dropped after the stream
    timeout and its request aborted; meanwhile the official client streams and gets refusals of
    oversized stop lists as a 400 naming the limit."""
    import socket

    engine = FakeEngine(delay=0, max_model_len=10**6)
    with serve_in_thread(build_app(engine, stream_timeout_s=0.5)) as url:
        port = int(url.rsplit(":", 1)[1])
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        body = json.dumps(
            {"prompt": "hi", "max_tokens": 200_000, "stream": True, "logprobs": 5}
        ).encode()
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        )
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="fake-model", prompt="hi", max_tokens=5, stream=True
            )
        )
        assert text == "abcde"
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model="fake-model", prompt="hi", max_tokens=5, stop=["x" * 2000]
            )
        assert "at most 1024 characters" in str(e.value)
        wait_for(lambda: len(engine.abort_calls) == 1, timeout=40)
        stalled.close()
    assert engine.closed_early == engine.abort_calls
