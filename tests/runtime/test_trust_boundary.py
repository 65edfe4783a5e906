"""No client can write another client's KV (issue 37): the internal endpoints and hand-over
headers need the internal key (runtime/server/trust.py), a forged segment imported over the
internal boundary never serves another request (runtime/engine/block_manager.py salts imported blocks),
`cache_salt` keeps tenants' prefix blocks apart, and the KV segment store is bounded in count,
bytes and upload time (runtime/disagg/segment.py, runtime/server/app.py)."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.disagg.protocol import KV_HEADER, PREFILL_HEADER
from slimserve.runtime.disagg.segment import MAGIC, new_name, read_segment, write_segment
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.engine.block_manager import BlockManager
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams, Sequence
from slimserve.runtime.server.app import build_app
from slimserve.runtime.server.trust import INTERNAL_KEY_HEADER
from tests.helpers.live_server import serve_in_thread
from tests.helpers.server_fakes import FakeEngine

pytestmark = pytest.mark.timeout(180)
DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo-model"
CFG = dict(model=str(DEMO), device="cpu", kv_cache_memory=8 * 2**20)
KEY = "test-internal-key"
IK = {INTERNAL_KEY_HEADER: KEY}
TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    ' * 3


@pytest.fixture(autouse=True)
def kv_dir(tmp_path, monkeypatch):
    d = tmp_path / "kv"
    monkeypatch.setenv("SLIMSERVE_KV_DIR", str(d))
    return d


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert "\n" not in err["message"] and "Traceback" not in err["message"]
    return err


def _complete(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json=body, headers=headers or {}, trust_env=False, timeout=120
    )


# -- the internal credential ---------------------------------------------------------------------


def test_a_server_with_default_flags_refuses_every_internal_call():
    """Without --internal-key nothing writes or reads KV segments or administers the server,
    whatever the client sends (its API key included)."""
    with TestClient(build_app(FakeEngine(), role="decode", api_key="client")) as c:
        bearer = {"Authorization": "Bearer client"}
        err = _err(c.post("/kv_segments", content=MAGIC + b"x", headers=bearer), 403)
        assert err["code"] == "internal_key_required" and "--internal-key" in err["message"]
        _err(c.get(f"/kv_segments/{new_name()}", headers=bearer), 403)
        for header in ({KV_HEADER: new_name()}, {PREFILL_HEADER: "1"}):
            r = c.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                headers={**bearer, **header},
            )
            assert "is internal" in _err(r, 403)["message"]
        for route in ("/reset_prefix_cache", "/start_profile", "/stop_profile"):
            _err(c.post(route, headers=bearer), 403)
        assert (
            c.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=bearer
            ).status_code
            == 200
        )  # ordinary requests are served


def test_a_wrong_or_missing_internal_key_is_401():
    with TestClient(build_app(FakeEngine(), role="decode", internal_key=KEY)) as c:
        for headers in ({}, {INTERNAL_KEY_HEADER: "guess"}, {"Authorization": f"Bearer {KEY}"}):
            err = _err(c.post("/kv_segments", content=MAGIC + b"x", headers=headers), 401)
            assert err["code"] == "invalid_internal_key"
            _err(
                c.post(
                    "/v1/completions",
                    json={"prompt": "hi"},
                    headers={**headers, KV_HEADER: new_name()},
                ),
                401,
            )


# -- prefix-cache poisoning ----------------------------------------------------------------------


def _forged_segment(prompt: list[int], other: list[int]) -> bytes:
    """A well-formed segment holding `other`'s K/V under `prompt`'s token ids (same length)."""
    engine = LLMEngine(EngineConfig(**CFG))
    seq = engine.make_sequence(
        "forge", other, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    )
    name = new_name()
    engine.add_sequence(seq, kv_export=name)
    while engine.has_unfinished():
        engine.step()
    header, tensors = read_segment(name)
    entries = header.pop("tensors")
    header["prompt_token_ids"] = list(prompt)
    forged = new_name()
    write_segment(forged, header, [(e["name"], tensors[e["name"]]) for e in entries])
    from slimserve.runtime.disagg.segment import segment_dir

    path = segment_dir() / forged
    data = path.read_bytes()
    path.unlink()
    return data


@pytest.fixture(scope="module")
def decode_pair():
    """Two decode servers of the demo model: one with default flags, one with an internal key."""
    with ExitStack() as stack:
        plain = build_app(AsyncEngine(LLMEngine(EngineConfig(**CFG))), role="decode")
        keyed = build_app(
            AsyncEngine(LLMEngine(EngineConfig(**CFG))), role="decode", internal_key=KEY
        )
        yield (
            stack.enter_context(serve_in_thread(plain, 60)),
            stack.enter_context(serve_in_thread(keyed, 60)),
            keyed,
        )


def test_a_forged_segment_does_not_change_another_clients_output(decode_pair, kv_dir):
    plain, keyed, app = decode_pair
    tok = app.state.serving.engine.tokenizer
    prompt = tok.encode(TEXT)
    other = [(t * 7 + 13) % 1000 + 100 for t in prompt]  # same length, other tokens
    forged = _forged_segment(prompt, other)
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
    longer = {**body, "prompt": prompt + tok.encode(" return")}
    for url in (plain, keyed):
        base, base_longer = (_complete(url, b).json()["choices"][0]["text"] for b in (body, longer))
        # the hostile client, straight to the replica: refused on a server with default flags
        if url == plain:
            _err(httpx.post(url + "/kv_segments", content=forged, trust_env=False), 403)
        else:  # over the internal boundary (a compromised or buggy prefill replica)
            httpx.post(url + "/reset_prefix_cache", headers=IK, trust_env=False)
            up = httpx.post(url + "/kv_segments", content=forged, headers=IK, trust_env=False)
            assert up.status_code == 201, up.text
            r = _complete(url, body, {**IK, KV_HEADER: up.json()["kv_segment"]})
            assert r.status_code == 200, r.text
        # another client, no headers: the greedy output it gets with or without the import
        after = _complete(url, body).json()
        assert after["choices"][0]["text"] == base
        assert _complete(url, longer).json()["choices"][0]["text"] == base_longer
        if url == keyed:  # it recomputed: the imported blocks serve nobody else
            assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert not list(kv_dir.glob("slimserve-kv-*"))


def test_imported_blocks_are_registered_only_under_their_own_salt():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(100, 113))  # 3 full blocks and one token

    def seq(rid: str, salt: str | None = None) -> Sequence:
        return Sequence(rid, list(tokens), SamplingParams(cache_salt=salt))

    imported = seq("imported")
    bm.allocate_imported(imported, len(tokens))
    bm.commit(imported)
    assert imported.import_salt is not None
    assert bm.lookup_prefix(seq("plain")) == 0  # a plain request for the same prompt recomputes
    computed = seq("computed")
    bm.allocate_prefix(computed)
    bm.append_slots(computed, len(tokens))
    computed.num_computed_tokens = len(tokens)
    bm.commit(computed)
    assert bm.lookup_prefix(seq("again")) == 12  # what this server computed is shared
    assert bm.lookup_prefix(seq("tenant", salt="a")) == 0  # but not across salts
    salted = seq("a1", salt="a")
    bm.allocate_prefix(salted)
    bm.append_slots(salted, len(tokens))
    salted.num_computed_tokens = len(tokens)
    bm.commit(salted)
    assert bm.lookup_prefix(seq("a2", salt="a")) == 12 and bm.lookup_prefix(seq("b", "b")) == 0


# -- cache_salt ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def colocated():
    with serve_in_thread(build_app(AsyncEngine(LLMEngine(EngineConfig(**CFG)))), 60) as url:
        yield url


def test_cache_salt_keeps_tenants_prefix_blocks_apart(colocated):
    prompt = [(i * 37) % 1500 + 200 for i in range(70)]  # 4 full blocks of 16

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = _complete(colocated, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 64  # same tenant: its prefix is cached
    assert cached("tenant-b") == 0 and cached(None) == 0  # other tenants and unsalted: not
    assert cached(None) == 64
    for bad in ("", "x" * 257, 5):
        err = _err(
            _complete(colocated, {"prompt": prompt, "max_tokens": 2, "cache_salt": bad}), 400
        )
        assert err["param"] == "cache_salt"


def test_require_cache_salt_refuses_requests_without_one():
    with TestClient(build_app(FakeEngine(), require_cache_salt=True)) as c:
        err = _err(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 400)
        assert err["param"] == "cache_salt" and "--require-cache-salt" in err["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        _err(c.post("/v1/chat/completions", json=chat), 400)
        assert c.post("/v1/chat/completions", json={**chat, "cache_salt": "t"}).status_code == 200


# -- bounded segment storage -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def decode_small():
    """A decode server with the default store limits and a short body timeout."""
    app = build_app(
        AsyncEngine(LLMEngine(EngineConfig(**CFG))),
        role="decode",
        internal_key=KEY,
        body_timeout_s=1.0,
    )
    with serve_in_thread(app, 60) as url:
        yield url, app.state.serving


def test_a_segment_flood_is_refused_with_503_and_retry_after(decode_small, kv_dir):
    url, serving = decode_small
    cap = serving.engine.kv_segment_max_bytes()
    blob = MAGIC + bytes(cap - len(MAGIC))  # one whole context's KV, the most one upload holds
    codes = []
    for _ in range(12):
        r = httpx.post(url + "/kv_segments", content=blob, headers=IK, trust_env=False, timeout=60)
        codes.append(r.status_code)
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and _err(r, 503)["code"] == "kv_store_full"
    assert codes == [201] * 4 + [503] * 8  # the default: 4 contexts' worth of bytes
    held = list(kv_dir.iterdir())
    assert len(held) == 4 and sum(p.stat().st_size for p in held) <= 4 * cap  # no partial files
    # expired (or imported) segments make room again
    serving.engine.kv_segments.expire(time.monotonic() + 3600)
    assert not list(kv_dir.iterdir())
    r = httpx.post(url + "/kv_segments", content=blob, headers=IK, trust_env=False, timeout=60)
    assert r.status_code == 201
    serving.engine.kv_segments.close()


def test_the_segment_count_is_bounded_too(kv_dir):
    app = build_app(FakeEngine(), role="decode", internal_key=KEY, kv_segments_max=3)
    app.state.serving.engine.kv_segment_max_bytes = lambda: 2**20
    from slimserve.runtime.disagg.segment import SegmentRegistry

    app.state.serving.engine.kv_segments = SegmentRegistry()
    with TestClient(app) as c:
        codes = [
            c.post("/kv_segments", content=MAGIC + b"x", headers=IK).status_code for _ in range(5)
        ]
    assert codes == [201, 201, 201, 503, 503] and len(list(kv_dir.iterdir())) == 3
    app.state.serving.engine.kv_segments.close()


def test_a_stalled_upload_is_cut_off_by_the_body_timeout(decode_small, kv_dir):
    url, _ = decode_small
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            f"POST /kv_segments HTTP/1.1\r\nHost: t\r\nContent-Length: {2**20}\r\n"
            f"{INTERNAL_KEY_HEADER}: {KEY}\r\n\r\n".encode()
            + MAGIC
            + bytes(65536)
        )
        s.settimeout(60)  # the body never completes: only the server's timeout can answer
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = s.recv(4096)
            assert chunk, "connection closed without an answer"
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert not list(kv_dir.iterdir())  # the partial upload is gone
