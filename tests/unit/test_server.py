"""The OpenAI-compatible server against a fake AsyncEngine (notes/engine_api.md).

The fake generates one character per step ("a", "b", "c", ... shifted by the seed) after a
small delay, so every answer is known in advance and the tests need no model. Most tests use
Starlette's TestClient (in-process, buffered); the official `openai` client and client
disconnects are tested against a real uvicorn server on a free port in a thread.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from slimserve.runtime.errors import EngineDeadError, RequestError
from slimserve.runtime.sequence import CompletionOutput, RequestOutput, SamplingParams
from slimserve.runtime.server.app import build_app

pytestmark = pytest.mark.timeout(60)
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.25
    prefix_cache_hit_rate: float = 0.5
    num_preemptions: int = 3
    num_blocks: int = 64
    block_size: int = 16
    capacity_tokens: int = 1024


class FakeTokenizer:
    """One token per character (token id = code point); renders TEMPLATE-shaped chat prompts."""

    eos_token_id = 0

    def __init__(self, chat_template: str | None = TEMPLATE):
        self.chat_template = chat_template

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt
        if any(m["content"] == "REJECT" for m in messages):
            raise ValueError("Conversation roles must alternate user/assistant")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """The AsyncEngine interface, deterministic: step i yields chr(ord('a') + (i + seed) % 26)."""

    def __init__(self, delay: float = 0.002, max_model_len: int = 64, chat_template=TEMPLATE):
        self.model_name = "fake-model"
        self.tokenizer = FakeTokenizer(chat_template)
        self.max_model_len = max_model_len
        self.delay = delay  # s per generated token
        self.started = self.shut_down = False
        self.dead = False  # generate/stats raise EngineDeadError
        self.die_after: int | None = None  # raise EngineDeadError after this many tokens
        self.fail_with: Exception | None = None  # generate raises this (an engine bug)
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.abort_calls: list[str] = []  # engine.abort(request_id) calls
        self.closed_early: list[str] = []  # generators the consumer left before the end
        self.waiting = 0
        self._aborts: dict[str, asyncio.Event] = {}

    async def start(self):
        self.started = True

    async def shutdown(self):
        self.shut_down = True

    def stats(self):
        if self.dead:
            raise EngineDeadError("fake engine died")
        return FakeStats(num_running=len(self._aborts), num_waiting=self.waiting)

    def abort(self, request_id):
        self.abort_calls.append(request_id)
        if request_id in self._aborts:
            self._aborts[request_id].set()

    def _output(self, rid, prompt, ids, text, lps, reason, stop, t) -> RequestOutput:
        return RequestOutput(rid, prompt, [CompletionOutput(0, text, list(ids), lps and list(lps),
                                                            reason, stop)], reason is not None,
                             metrics=t)

    async def generate(self, prompt, params, request_id):
        if self.dead:
            raise EngineDeadError("fake engine died")
        if self.fail_with is not None:
            raise self.fail_with
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt", "is empty; send at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestError("prompt", f"has {len(ids)} tokens; limit {self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"ask for at most {self.max_model_len - len(ids)}")
        self.requests.append((request_id, ids, params))
        aborted = self._aborts[request_id] = asyncio.Event()
        t = {"arrival": time.monotonic()}
        out_ids, lps, finished = [], [] if params.logprobs is not None else None, False
        try:
            for i in range(params.max_tokens):
                try:
                    await asyncio.wait_for(aborted.wait(), self.delay)
                    finished = True
                    yield self._output(request_id, ids, out_ids, self.tokenizer.decode(out_ids),
                                       lps, "abort", None, t)
                    return
                except asyncio.TimeoutError:
                    pass
                if self.die_after is not None and i >= self.die_after:
                    raise EngineDeadError("fake engine died mid-request")
                tok = ord("a") + (i + (params.seed or 0)) % 26
                out_ids.append(tok)
                if lps is not None:
                    top = {tok: -0.5, tok + 1: -1.5, tok + 2: -2.5}
                    lps.append((-0.5, dict(list(top.items())[:params.logprobs])))
                t.setdefault("first_token", time.monotonic())
                t["last_token"] = time.monotonic()
                text, reason, stop = self.tokenizer.decode(out_ids), None, None
                hits = [(text.find(s), s) for s in params.stop if s in text]
                if hits:
                    cut, stop = min(hits)
                    text, reason = text[:cut], "stop"
                elif tok in params.stop_token_ids:
                    reason, stop = "stop", tok
                elif i == params.max_tokens - 1:
                    reason = "length"
                if reason:
                    t["finish"] = time.monotonic()
                    finished = True
                yield self._output(request_id, ids, out_ids, text, lps, reason, stop, t)
                if finished:
                    return
        finally:
            self._aborts.pop(request_id, None)
            if not finished:
                self.closed_early.append(request_id)


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine)) as c:
        yield c


def events(text: str) -> list:
    """The JSON objects of an SSE body, and the final '[DONE]' as a string."""
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# -- happy paths -----------------------------------------------------------------------------------

def test_completion_answer_shape_and_params(client, engine):
    r = client.post("/v1/completions", json={
        "model": "fake-model", "prompt": "hi", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
        "top_k": 5, "seed": 1, "stop_token_ids": [99], "ignore_eos": True, "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == "fake-model"
    assert body["choices"][0]["text"] == "bc"  # seed 1 shifts by one; 'c' (99) is a stop token
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == 99
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    rid, ids, p = engine.requests[-1]
    assert rid == body["id"] and ids == [ord("h"), ord("i")]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop_token_ids, p.ignore_eos) \
        == (4, 0.5, 0.9, 5, 1, [99], True)


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
    body = client.post("/v1/completions",
                       json={"prompt": "x", "max_tokens": 2, "logprobs": 1}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"] == [{"a": -0.5}, {"b": -0.5}] and lp["text_offset"] == [0, 1]


def test_chat_template_default_max_tokens_and_logprobs(client, engine):
    r = client.post("/v1/chat/completions", json={
        "model": "fake-model", "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
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
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
        "max_tokens": 9})
    assert r.json()["choices"][0]["message"]["content"] == "abc"  # max_completion_tokens wins


def test_chat_fallback_format_without_template():
    engine = FakeEngine(chat_template=None)
    with TestClient(build_app(engine)) as c:
        c.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
            {"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]})
    assert "".join(map(chr, engine.requests[-1][1])) == "System: S\nUser: hi\nAssistant:"


def test_stream_completion_matches_non_stream_and_usage(client):
    req = {"prompt": "hi", "max_tokens": 5, "logprobs": 0}
    whole = client.post("/v1/completions", json=req).json()
    r = client.post("/v1/completions",
                    json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = events(r.text)
    assert ev[-1] == "[DONE]"
    chunks, usage = ev[:-2], ev[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert all(c["usage"] is None and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 5
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_stream_chat_chunks(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    ev = events(r.text)
    assert ev[-1] == "[DONE]"
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in ev[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in ev[1:-1]) == "abc"
    assert ev[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_holds_back_a_partial_stop_string(client):
    """'c' and 'cd' could start the stop string 'cde'; streamed text cannot be taken back."""
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stop": ["cde"],
                                             "stream": True})
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
    for line in ["slimserve:num_requests_running 0.0", "slimserve:num_requests_waiting 0.0",
                 "slimserve:kv_cache_usage_perc 0.25", "slimserve:prefix_cache_hit_rate 0.5",
                 "slimserve:num_preemptions_total 3.0", "slimserve:prompt_tokens_total 4.0",
                 "slimserve:generation_tokens_total 5.0",
                 "slimserve:time_to_first_token_seconds_count 2.0",
                 "slimserve:inter_token_latency_seconds_count 3.0",
                 "slimserve:e2e_request_latency_seconds_count 2.0",
                 'slimserve:request_success_total{finished_reason="length"} 1.0',
                 'slimserve:request_success_total{finished_reason="stop"} 1.0']:
        assert line in text, line
    with TestClient(build_app(FakeEngine())) as c2:  # a second app: its own registry
        assert "slimserve:prompt_tokens_total 0.0" in c2.get("/metrics").text


# -- errors ----------------------------------------------------------------------------------------

def _msgs(content="hi"):
    return [{"role": "user", "content": content}]


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
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [1, "b"]}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": "hi", "n": 2}, "n"),
    ("completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": _msgs([{"type": "image_url", "image_url": {}}])}, "messages"),
    ("chat/completions", {"messages": _msgs("REJECT")}, "messages"),  # template raises
    ("chat/completions", {"messages": _msgs("x" * 64)}, "messages"),  # too long for the engine
    ("chat/completions", {"messages": _msgs(), "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": _msgs(), "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": _msgs(), "max_completion_tokens": 100},
     "max_completion_tokens"),
    ("chat/completions", {"messages": _msgs(), "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p)
                                                          in enumerate(BAD)])
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


def test_unknown_model_route_and_internal_error_do_not_leak(engine):
    with TestClient(build_app(engine), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
        assert r.status_code == 404
        assert r.json()["error"] | {"message": ""} == {
            "message": "", "type": "invalid_request_error", "param": "model",
            "code": "model_not_found"}
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
        r = c.post("/v1/chat/completions", json={"messages": _msgs()})
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
        task = asyncio.ensure_future(c.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 50, "stream": True}))
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


# -- a real server: the official client, disconnects --------------------------------------------

@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(delay=0.01)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, api_key="sk-test"),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield engine, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_official_openai_client(live):
    engine, url = live
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
    assert [m.id for m in c.models.list()] == ["fake-model"]
    r = c.completions.create(model="fake-model", prompt="hi", max_tokens=3, seed=2)
    assert r.choices[0].text == "cde" and r.usage.total_tokens == 5
    parts = list(c.completions.create(model="fake-model", prompt="hi", max_tokens=4, stream=True,
                                      stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == "abcd"
    assert parts[-1].usage.completion_tokens == 4
    r = c.chat.completions.create(model="fake-model", messages=_msgs(), max_tokens=2,
                                  logprobs=True, top_logprobs=1)
    assert r.choices[0].message.content == "ab" and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.content[0].top_logprobs[0].token == "a"
    parts = list(c.chat.completions.create(model="fake-model", messages=_msgs(), max_tokens=3,
                                           stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == "abc"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="fake-model", prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_client_disconnect_aborts_the_request(live):
    engine, url = live
    auth = {"Authorization": "Bearer sk-test"}
    with httpx.Client(base_url=url, headers=auth, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 60,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line)[len("data: "):])
        # leaving the block closed the connection mid-stream
        _wait_for(lambda: first["id"] in engine.closed_early or first["id"] in engine.abort_calls)
        assert len(engine.requests[-1][1]) == 2 and engine.requests[-1][0] == first["id"]
        n = len(engine.requests)
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request, abandoned while running
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 60}, timeout=0.1)
        _wait_for(lambda: len(engine.requests) > n)
        rid = engine.requests[n][0]
        _wait_for(lambda: rid in engine.closed_early or rid in engine.abort_calls)


# -- `runtime serve` -----------------------------------------------------------------------------

def test_serve_cli_config_errors_and_startup(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from slimserve.runtime import cli
    from slimserve.runtime.async_engine import AsyncEngine
    from slimserve.runtime.errors import ArtifactError

    run = CliRunner().invoke
    for args, needle in [([str(tmp_path / "missing")], "model:"),
                         ([str(tmp_path), "--block-size", "3"], "block_size:"),
                         ([str(tmp_path), "--kv-cache-dtype", "int4"], "kv_cache_dtype:"),
                         ([str(tmp_path), "--kv-cache-memory", "lots"], "kv_cache_memory:")]:
        r = run(cli.app, ["serve", *args])
        assert r.exit_code == 2 and needle in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output

    seen = {}

    def from_config(config):
        seen["config"] = config
        if config.served_model_name == "broken":
            raise ArtifactError(f"{config.model}/config.json: quant_method 'x' is not supported")
        return FakeEngine()

    monkeypatch.setattr(AsyncEngine, "from_config", staticmethod(from_config))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.update(server=self))
    r = run(cli.app, ["serve", str(tmp_path), "--served-model-name", "broken"])
    assert r.exit_code == 2 and "quant_method" in r.output
    r = run(cli.app, ["serve", str(tmp_path), "--port", "9001", "--max-num-seqs", "3",
                      "--max-num-batched-tokens", "256", "--max-model-len", "128",
                      "--block-size", "32", "--kv-cache-dtype", "fp8_e4m3",
                      "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching", "--device", "cpu",
                      "--dtype", "float32", "--served-model-name", "m", "--api-key", "k",
                      "--max-queue", "4"])
    assert r.exit_code == 0, r.output
    assert "1024 tokens" in r.output  # the engine's capacity, from stats()
    cfg = seen["config"]
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.block_size,
            cfg.kv_cache_dtype, cfg.kv_cache_memory, cfg.enable_prefix_caching, cfg.device,
            cfg.dtype, cfg.served_model_name, cfg.trust_remote_code) == \
        (3, 256, 128, 32, "fp8_e4m3", 2**30, False, "cpu", "float32", "m", False)
    server = seen["server"]
    assert (server.config.host, server.config.port) == ("127.0.0.1", 9001)
    serving = server.config.app.state.serving
    assert serving.max_queue == 4
    with TestClient(server.config.app) as c:
        assert c.get("/v1/models").status_code == 401
