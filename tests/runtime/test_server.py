"""The OpenAI-compatible server against a fake AsyncEngine (tests/helpers/server_fakes.py).

Starlette's TestClient (in-process, buffered); the official `openai` client, client disconnects
and `runtime serve` are in test_server_live.py.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from slimserve.runtime.errors import RequestError
from slimserve.runtime.server.app import build_app
from tests.helpers.server_fakes import FakeEngine, chat_messages, events

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine)) as c:
        yield c


# -- happy paths -----------------------------------------------------------------------------------


def test_completion_answer_shape_and_params(client, engine):
    r = client.post(
        "/v1/completions",
        json={
            "model": "fake-model",
            "prompt": "hi",
            "max_tokens": 4,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 1,
            "stop_token_ids": [99],
            "ignore_eos": True,
            "user": "u1",
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == "fake-model"
    assert body["choices"][0]["text"] == "bc"  # seed 1 shifts by one; 'c' (99) is a stop token
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == 99
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    rid, ids, p = engine.requests[-1]
    assert rid == body["id"] and ids == [ord("h"), ord("i")]
    assert (
        p.max_tokens,
        p.temperature,
        p.top_p,
        p.top_k,
        p.seed,
        p.stop_token_ids,
        p.ignore_eos,
    ) == (4, 0.5, 0.9, 5, 1, frozenset({99}), True)


def test_completion_defaults_token_prompt_echo_and_stop(client, engine):
    body = client.post("/v1/completions", json={"prompt": [104, 105], "echo": True}).json()
    assert body["choices"][0]["text"] == "hi" + "abcdefghijklmnop"  # default max_tokens 16
    assert body["choices"][0]["finish_reason"] == "length"
    p = engine.requests[-1][2]
    assert (p.temperature, p.top_p, p.top_k, p.logprobs, p.stop) == (1.0, 1.0, -1, None, [])
    body = client.post("/v1/completions", json={"prompt": ["hi"], "stop": "d"}).json()
    assert body["choices"][0]["text"] == "abc" and body["choices"][0]["stop_reason"] == "d"
    assert engine.requests[-1][2].stop == ["d"]
    r = client.post("/v1/completions", json={"prompt": "hi", "temperature": 1e-45, "max_tokens": 1})
    assert r.status_code == 200 and engine.requests[-1][2].temperature == 0  # greedy, not inf/NaN


def test_completion_logprobs(client):
    body = client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1}
    ).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"] == [{"a": -0.5}, {"b": -0.5}] and lp["text_offset"] == [0, 1]


def test_chat_template_default_max_tokens_and_logprobs(client, engine):
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "logprobs": True,
            "top_logprobs": 2,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    _, ids, p = engine.requests[-1]
    prompt = "<system>be brief<user>hi<assistant>"  # developer is the system role for templates
    assert "".join(map(chr, ids)) == prompt
    assert p.max_tokens == engine.max_model_len - len(prompt) and p.logprobs == 2
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].startswith("abc")
    first = body["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == "a" and first["bytes"] == [97] and first["logprob"] == -0.5
    assert [e["token"] for e in first["top_logprobs"]] == ["a", "b"]
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3,
            "max_tokens": 9,
        },
    )
    assert r.json()["choices"][0]["message"]["content"] == "abc"  # max_completion_tokens wins


def test_chat_fallback_format_without_template():
    engine = FakeEngine(chat_template=None)
    with TestClient(build_app(engine)) as c:
        c.post(
            "/v1/chat/completions",
            json={
                "max_tokens": 1,
                "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
            },
        )
    assert "".join(map(chr, engine.requests[-1][1])) == "System: S\nUser: hi\nAssistant:"


def test_stream_completion_matches_non_stream_and_usage(client):
    req = {"prompt": "hi", "max_tokens": 5, "logprobs": 0}
    whole = client.post("/v1/completions", json=req).json()
    r = client.post(
        "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = events(r.text)
    assert ev[-1] == "[DONE]"
    chunks, usage = ev[:-2], ev[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert all(c["usage"] is None and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 5
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_n_choices_seeded_apart_with_summed_usage(client, engine):
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "seed": 1, "n": 3, "logprobs": 0}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["bcd", "cde", "def"]  # seeds 1, 2, 3
    assert all(c["logprobs"]["text_offset"] == [0, 1, 2] for c in body["choices"])  # per choice
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 9,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    rids = [rid for rid, _, _ in engine.requests[-3:]]
    assert rids == [f"{body['id']}-{i}" for i in range(3)]
    assert [p.seed for _, _, p in engine.requests[-3:]] == [1, 2, 3]


def test_n_choices_stream_interleaved_per_index(client):
    req = {"messages": chat_messages(), "max_tokens": 4, "seed": 5, "n": 2}
    whole = client.post("/v1/chat/completions", json=req).json()
    r = client.post(
        "/v1/chat/completions",
        json={**req, "stream": True, "stream_options": {"include_usage": True}},
    )
    ev = events(r.text)
    assert ev[-1] == "[DONE]" and ev.count("[DONE]") == 1
    chunks, usage = ev[:-2], ev[-2]
    texts, roles, finished = {0: "", 1: ""}, [], []
    for c in chunks:
        (choice,) = c["choices"]
        roles += [choice["index"]] if choice["delta"].get("role") else []
        texts[choice["index"]] += choice["delta"].get("content", "")
        finished += [choice["index"]] if choice["finish_reason"] else []
    assert sorted(roles) == [0, 1] and sorted(finished) == [0, 1]
    assert [texts[i] for i in (0, 1)] == [c["message"]["content"] for c in whole["choices"]]
    assert texts[0] != texts[1] and usage["usage"]["completion_tokens"] == 8


def test_a_refused_later_choice_ends_the_started_ones(client, engine, monkeypatch):
    real, calls = engine.generate, []

    def generate(prompt, params, request_id):
        calls.append(request_id)
        if len(calls) == 2:
            raise RequestError("max_tokens", "too many for the second choice")
        return real(prompt, params, request_id)

    monkeypatch.setattr(engine, "generate", generate)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert len(calls) == 2 and calls[0] in engine.abort_calls


def test_choice_seeds_wrap_into_the_seed_range():
    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.server.protocol import choice_params

    seeds = [p.seed for p in choice_params(SamplingParams(max_tokens=1, seed=2**64 - 1), 3)]
    assert seeds == [2**64 - 1, 0, 1]
    assert [p.seed for p in choice_params(SamplingParams(max_tokens=1), 2)] == [None, None]


def test_stream_chat_chunks(client):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
    )
    ev = events(r.text)
    assert ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in ev[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in ev[1:-1]) == "abc"
    assert ev[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_holds_back_a_partial_stop_string(client):
    """'c' and 'cd' could start the stop string 'cde'; streamed text cannot be taken back."""
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stop": ["cde"], "stream": True}
    )
    chunks = events(r.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_models_health_metrics_and_lifespan(engine):
    with TestClient(build_app(engine)) as c:
        assert engine.started and not engine.shut_down
        models = c.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
        assert c.get("/v1/models/fake-model").json()["max_model_len"] == 64
        assert c.get("/health").json() == {"status": "ok"}
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9, "stop": "b"})
        text = c.get("/metrics").text
        engine.dead = True
        assert c.get("/health").status_code == 503
        assert c.get("/metrics").status_code == 200  # request metrics still render
    assert engine.shut_down
    for line in [
        "slimserve:num_requests_running 0.0",
        "slimserve:num_requests_waiting 0.0",
        "slimserve:kv_cache_usage_perc 0.25",
        "slimserve:prefix_cache_hit_rate 0.5",
        "slimserve:num_preemptions_total 3.0",
        "slimserve:cpu_threads 2.0",
        "slimserve:cpu_thread_changes_total 1.0",
        "slimserve:prompt_tokens_total 4.0",
        "slimserve:generation_tokens_total 5.0",
        "slimserve:time_to_first_token_seconds_count 2.0",
        "slimserve:inter_token_latency_seconds_count 3.0",
        "slimserve:e2e_request_latency_seconds_count 2.0",
        'slimserve:request_success_total{finished_reason="length"} 1.0',
        'slimserve:request_success_total{finished_reason="stop"} 1.0',
    ]:
        assert line in text, line
    with TestClient(build_app(FakeEngine())) as c2:  # a second app: its own registry
        assert "slimserve:prompt_tokens_total 0.0" in c2.get("/metrics").text


# -- errors ----------------------------------------------------------------------------------------

BAD = [  # (endpoint, body, param named in the error)
    ("completions", b'{"prompt": "hi", ', None),
    ("completions", b'["hi"]', None),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 63}, "max_tokens"),  # 2 + 63 > 64, engine
    ("completions", {"prompt": "x" * 64}, "prompt"),  # engine: longer than max_model_len
    ("completions", {"prompt": "hi", "temperature": -0.1}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": 0}, "top_k"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, "b"]}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": "hi", "n": 17}, "n"),
    ("chat/completions", {"messages": chat_messages(), "n": 0}, "n"),
    ("completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    (
        "chat/completions",
        {"messages": chat_messages([{"type": "image_url", "image_url": {}}])},
        "messages",
    ),
    ("chat/completions", {"messages": chat_messages("REJECT")}, "messages"),  # template raises
    (
        "chat/completions",
        {"messages": chat_messages("x" * 64)},
        "messages",
    ),  # too long for the engine
    ("chat/completions", {"messages": chat_messages(), "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": chat_messages(), "logprobs": 3}, "logprobs"),
    (
        "chat/completions",
        {"messages": chat_messages(), "max_completion_tokens": 100},
        "max_completion_tokens",
    ),
    ("chat/completions", {"messages": chat_messages(), "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize(
    "endpoint,body,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)]
)
def test_bad_requests_get_openai_400(client, engine, endpoint, body, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post(f"/v1/{endpoint}", headers={"content-type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"] and "Traceback" not in err["message"]
    if param:
        assert param in err["message"]
    assert engine.closed_early == []  # nothing half-started in the engine


def test_a_list_of_prompts_is_one_choice_each(client):
    """OpenAI's completions take a batch of prompts (lm-eval sends them): a choice per prompt,
    indexed in order, and usage counts every prompt."""
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 6


def test_unknown_model_route_and_internal_error_do_not_leak(engine):
    with TestClient(build_app(engine), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        assert r.status_code == 404
        assert r.json()["error"] | {"message": ""} == {
            "message": "",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        assert c.get("/v1/models/gpt-4").status_code == 404
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        engine.fail_with = RuntimeError("secret /srv/weights path")
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and "secret" not in r.text
        assert r.json()["error"]["type"] == "server_error"


def test_engine_death(engine, client):
    engine.die_after = 2
    r = client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    ev = events(r.text)
    assert ev[-1] == "[DONE]" and ev[-2]["error"]["type"] == "server_error"
    assert "".join(c["choices"][0]["text"] for c in ev[:-2]) == "ab"
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    engine.dead = True
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503


def test_api_key(engine):
    with TestClient(build_app(engine, api_key="sk-right")) as c:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-right"}):
            r = c.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers=headers).status_code == 401
        ok = {"Authorization": "Bearer sk-right"}
        assert c.post("/v1/completions", json={"prompt": "hi"}, headers=ok).status_code == 200
        r = c.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 401  # auth before parsing
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_max_queue_answers_503_with_retry_after(engine):
    with TestClient(build_app(engine, max_queue=2)) as c:
        engine.waiting = 1
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
        engine.waiting = 2
        r = c.post("/v1/chat/completions", json={"messages": chat_messages()})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        assert 'slimserve:request_rejected_total{reason="queue_full"} 1.0' in c.get("/metrics").text
    assert len(engine.requests) == 1


@pytest.mark.anyio
async def test_drain_ends_open_streams_with_abort():
    """Server shutdown (serving.drain) ends an open stream cleanly: finish_reason abort, [DONE]."""
    engine = FakeEngine(delay=0.02)
    app = build_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        task = asyncio.ensure_future(
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": True})
        )
        while not engine.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        app.state.serving.drain()
        ev = events((await task).text)
        assert ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "abort"
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


@pytest.fixture
def anyio_backend():
    return "asyncio"
