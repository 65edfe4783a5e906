"""Prefill/decode disaggregation (runtime/disagg/): the shared-memory segments, the layout check,
the engine hooks (same tokens as one engine, greedy and seeded), and live: a prefill and a decode
replica of the demo model behind the router give the tokens one engine gives, plain, streamed
and chat, and a mismatched or missing hand-over is a clear error; replicas on two hosts (their
/state `kv_host` differs) get the segments moved over HTTP by the router."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.disagg.errors import KVHandleError, KVLayoutError, KVSegmentMissing
from slimserve.runtime.disagg.layout import KVLayout
from slimserve.runtime.disagg.protocol import KV_HEADER, PREFILL_HEADER, parse_kv_header
from slimserve.runtime.disagg.segment import (
    MAGIC,
    SegmentRegistry,
    host_id,
    new_name,
    read_segment,
    sweep_orphans,
    write_segment,
)
from slimserve.runtime.disagg.transfer import load_import
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.router.app import build_router_app
from slimserve.runtime.router.policy import LeastLatency, ReplicaState, RoundRobin
from slimserve.runtime.server.app import build_app
from slimserve.runtime.server.trust import INTERNAL_KEY_HEADER
from tests.helpers.live_server import serve_in_thread, wait_for

pytestmark = pytest.mark.timeout(120)
DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo-model"
KEY = "test-internal-key"  # the deployment's internal key (runtime/server/trust.py)
IK = {INTERNAL_KEY_HEADER: KEY}
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    ' * 3


@pytest.fixture(autouse=True)
def kv_dir(tmp_path, monkeypatch):
    d = tmp_path / "kv"
    monkeypatch.setenv("SLIMSERVE_KV_DIR", str(d))
    return d


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(DEMO), device="cpu", kv_cache_memory=8 * 2**20, **kw))


@pytest.fixture(scope="module")
def engines():
    return _engine(), _engine()


def _run(engine: LLMEngine) -> dict:
    outs: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o  # cumulative outputs (offline mode): the latest has all
    return outs


def _handover(prefill: LLMEngine, decode: LLMEngine, prompt, params: SamplingParams, rid: str):
    """Prefill on one engine, export, import on the other; the decode side's final output."""
    seq = prefill.make_sequence(rid + "-p", prompt, params)
    seq.params = dataclasses.replace(
        params, max_tokens=1, stop=[], stop_token_ids=frozenset(), ignore_eos=True
    )
    name = new_name()
    prefill.add_sequence(seq, kv_export=name)
    assert _run(prefill)[rid + "-p"].error is None
    seq2 = decode.make_sequence(rid, prompt, params)
    decode.add_sequence(seq2, kv_import=load_import(name, decode.kv_layout, seq2.prompt_token_ids))
    return _run(decode)[rid]


# -- segments ------------------------------------------------------------------------------------


def test_segment_roundtrip_is_read_once(kv_dir):
    name = new_name()
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    write_segment(name, {"hello": 1}, [("t", t), ("s", torch.tensor([0.5]))])
    assert (kv_dir / name).exists() and not list(kv_dir.glob("*.part"))
    assert oct((kv_dir / name).stat().st_mode & 0o777) == "0o600"
    header, tensors = read_segment(name)
    assert header["hello"] == 1 and torch.equal(tensors["t"], t) and tensors["s"].item() == 0.5
    assert not (kv_dir / name).exists()  # unlinked once read
    with pytest.raises(KVSegmentMissing, match="does not exist.*imported already, expired"):
        read_segment(name)
    with pytest.raises(KVHandleError, match="not a slimserve KV segment name"):
        read_segment("../../etc/passwd")
    bad = new_name()
    (kv_dir / bad).write_bytes(b"garbage" * 10)
    with pytest.raises(KVHandleError, match="bad magic"):
        read_segment(bad)


def test_unimported_segments_expire_and_orphans_are_swept(kv_dir):
    reg = SegmentRegistry(ttl_s=5.0)
    old, fresh = new_name(), new_name()
    for n in (old, fresh):
        write_segment(n, {}, [])
        reg.add(n)
    reg._written[old] -= 10  # written 10 s ago
    assert reg.expire() == 1 and not (kv_dir / old).exists() and (kv_dir / fresh).exists()
    reg.close()
    assert not (kv_dir / fresh).exists()
    # a segment whose writer process has exited is swept; ours (alive) stays
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    orphan = f"slimserve-kv-{dead}-{'a' * 32}"
    (kv_dir / orphan).write_bytes(b"x")
    mine = new_name()
    (kv_dir / mine).write_bytes(b"x")
    assert sweep_orphans() == 1 and not (kv_dir / orphan).exists() and (kv_dir / mine).exists()


def test_kv_header_parsing():
    a, b = new_name(), new_name()
    assert parse_kv_header(f"{a}, {b}", 2) == [a, b]
    with pytest.raises(KVHandleError, match="1 segment\\(s\\) for n=2"):
        parse_kv_header(a, 2)
    with pytest.raises(KVHandleError, match="not a slimserve KV segment name"):
        parse_kv_header("/dev/shm/x", 1)


# -- layout --------------------------------------------------------------------------------------


def _layout(**kw) -> KVLayout:
    base = dict(
        kv_dtype="float8_e4m3fn",
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        num_layers=2,
        vocab_size=4096,
        hidden_size=384,
        num_heads=6,
        scales=((torch.ones(1), torch.ones(1)),) * 2,
    )
    return KVLayout(**{**base, **kw})


def test_layout_check_names_the_difference():
    here = _layout()
    here.check_matches(_layout())
    with pytest.raises(
        KVLayoutError,
        match="block_size is 32 on the prefill replica but 16 here; start both with --block-size",
    ):
        here.check_matches(_layout(block_size=32))
    with pytest.raises(KVLayoutError, match="kv_dtype is 'bfloat16'"):
        here.check_matches(_layout(kv_dtype="bfloat16"))
    per_head = ((torch.ones(2), torch.ones(2)),) * 2  # scales of any shape: one per KV head
    with pytest.raises(
        KVLayoutError,
        match=r"layer 0 k_scale has shape \[2\] on the prefill "
        r"replica but \[1\] here",
    ):
        here.check_matches(_layout(scales=per_head))
    _layout(scales=per_head).check_matches(_layout(scales=per_head))
    other = ((torch.ones(1), torch.ones(1)), (torch.ones(1), torch.full((1,), 0.5)))
    with pytest.raises(KVLayoutError, match="layer 1 v_scale differs"):
        here.check_matches(_layout(scales=other))
    with pytest.raises(KVLayoutError, match="has no FP8 k/v scales"):
        here.check_matches(_layout(scales=None))


def test_a_mismatched_layout_is_refused_not_imported(engines):
    prefill, _ = engines
    other = _engine(block_size=32)
    seq = prefill.make_sequence("m-p", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    name = new_name()
    prefill.add_sequence(seq, kv_export=name)
    _run(prefill)
    ids = other.make_sequence("m", PROMPT, SamplingParams(max_tokens=4)).prompt_token_ids
    with pytest.raises(KVLayoutError, match="block_size is 16 on the prefill replica but 32 here"):
        load_import(name, other.kv_layout, ids)
    assert not other.has_unfinished() and other.block_manager.usage == 0.0
    # a segment of another prompt is refused too
    name = new_name()
    seq = prefill.make_sequence("m2-p", PROMPT, SamplingParams(max_tokens=1))
    prefill.add_sequence(seq, kv_export=name)
    _run(prefill)
    with pytest.raises(KVLayoutError, match="not this request's"):
        load_import(name, prefill.kv_layout, ids[:-1])


# -- the engine hooks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=7),
    ],
    ids=["greedy", "seeded"],
)
def test_handover_gives_the_tokens_of_one_engine(engines, params):
    prefill, decode = engines
    prefill.add_request("ref", PROMPT, params)
    ref = _run(prefill)["ref"].outputs[0]
    got = _handover(prefill, decode, PROMPT, params, "h").outputs[0]
    assert got.token_ids == ref.token_ids and got.text == ref.text
    if params.logprobs is not None:
        assert [lp[0] for lp in got.logprobs] == pytest.approx(
            [lp[0] for lp in ref.logprobs], abs=1e-4
        )
    assert decode.block_manager.usage == 0.0  # everything freed at the end


def test_a_request_that_ends_at_its_first_token_needs_no_block(engines):
    prefill, decode = engines
    out = _handover(prefill, decode, PROMPT, SamplingParams(max_tokens=1, temperature=0), "one")
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert decode.block_manager.usage == 0.0 and not decode.has_unfinished()


# -- policies ------------------------------------------------------------------------------------


def test_decode_replica_choice():
    a, b = ReplicaState("http://a", role="decode"), ReplicaState("http://b", role="decode")
    a.num_running = 6
    assert LeastLatency().choose_decode([a, b]) is b
    b.num_running, b.kv_cache_usage = 1, 0.97  # nearly full: last
    assert LeastLatency().choose_decode([a, b]) is a
    rr = RoundRobin()
    rr.choose([a], None)  # the prefill cycle does not move the decode one
    assert [rr.choose_decode([a, b]) for _ in range(3)] == [a, b, a]


# -- live: router in front of a prefill and a decode replica -------------------------------------


@pytest.fixture(scope="module")
def live():
    """The servers run in this process: each test's SLIMSERVE_KV_DIR (kv_dir) is theirs too."""
    with ExitStack() as stack:
        cfg = dict(model=str(DEMO), device="cpu", kv_cache_memory=8 * 2**20)
        p_url = stack.enter_context(
            serve_in_thread(
                build_app(
                    AsyncEngine(LLMEngine(EngineConfig(**cfg))), role="prefill", internal_key=KEY
                ),
                60,
            )
        )
        d_url = stack.enter_context(
            serve_in_thread(
                build_app(
                    AsyncEngine(LLMEngine(EngineConfig(**cfg))), role="decode", internal_key=KEY
                ),
                60,
            )
        )
        app = build_router_app([p_url, d_url], poll_interval_s=0.05, internal_key=KEY)
        r_url = stack.enter_context(serve_in_thread(app, 30))
        wait_for(lambda: app.state.router.disaggregated(), 10, "both roles up")
        yield {"prefill": p_url, "decode": d_url, "router": r_url, "app": app}


def test_router_hands_over_and_matches_one_engine(live, kv_dir):
    direct = openai.OpenAI(base_url=live["prefill"] + "/v1", api_key="x", max_retries=0)
    routed = openai.OpenAI(base_url=live["router"] + "/v1", api_key="x", max_retries=0)
    model = routed.models.list().data[0].id
    kw = dict(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    ref = direct.completions.create(**kw)  # one colocated engine
    got = routed.completions.create(**kw)
    assert got.choices[0].text == ref.choices[0].text and got.usage == ref.usage
    parts = list(routed.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == ref.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "Write a function that adds two numbers."}]
    chat_ref = direct.chat.completions.create(
        model=model, messages=msgs, max_tokens=12, temperature=0
    )
    chat = routed.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == chat_ref.choices[0].message.content
    two = routed.completions.create(**{**kw, "max_tokens": 6}, n=2)  # a segment per choice
    assert [c.text for c in two.choices] == [ref.choices[0].text[: len(two.choices[0].text)]] * 2
    state = httpx.get(live["router"] + "/router/replicas", trust_env=False).json()["replicas"]
    assert {r["role"]: r["dispatched"] for r in state} == {"prefill": 4, "decode": 4}
    metrics = httpx.get(live["router"] + "/metrics", trust_env=False).text
    assert "slimserve_router:kv_handovers_total 4.0" in metrics
    assert not list(kv_dir.glob("slimserve-kv-*"))  # every segment imported and freed


def test_handover_errors_are_clear(live):
    body = {"prompt": PROMPT, "max_tokens": 5000}
    r = httpx.post(live["router"] + "/v1/completions", json=body, trust_env=False)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]  # from prefill
    gone = new_name()
    r = httpx.post(
        live["router"] + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2},
        headers={KV_HEADER: gone, PREFILL_HEADER: "1"},
        trust_env=False,
    )
    assert r.status_code == 200  # a client's hand-over headers are not forwarded
    r = httpx.post(
        live["decode"] + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4},
        headers={**IK, KV_HEADER: gone},
        trust_env=False,
    )
    assert r.status_code == 410 and r.json()["error"]["code"] == "kv_segment_missing"
    r = httpx.post(
        live["decode"] + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4},
        headers={**IK, KV_HEADER: "x", PREFILL_HEADER: "1"},
        trust_env=False,
    )
    assert r.status_code == 400 and "send one of them" in r.json()["error"]["message"]
    r = httpx.post(
        live["prefill"] + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4},
        headers={**IK, KV_HEADER: gone},
        trust_env=False,
    )  # a hand-over outside its role
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_role"
    assert "needs `runtime serve --role decode`" in r.json()["error"]["message"]
    # a segment computed for another prompt
    r = httpx.post(
        live["prefill"] + "/v1/completions",
        json={"prompt": "import os", "max_tokens": 4},
        headers={**IK, PREFILL_HEADER: "1"},
        trust_env=False,
    )
    assert r.status_code == 200, r.text
    seg = r.json()["kv_segments"]
    r = httpx.post(
        live["decode"] + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4},
        headers={**IK, KV_HEADER: ",".join(seg)},
        trust_env=False,
    )
    assert r.status_code == 409 and "not this request's" in r.json()["error"]["message"]
    state = httpx.get(live["prefill"] + "/state", trust_env=False).json()
    assert state["role"] == "prefill"
    assert (
        json.loads(httpx.get(live["decode"] + "/state", trust_env=False).text)["role"] == "decode"
    )


def _broken_decode_replica():
    """A decode replica that starts a stream and dies mid-way (no [DONE]), or fails a plain one."""
    app = FastAPI()
    app.state.bodies = []

    @app.get("/state")
    async def state():
        return {"role": "decode", "num_running": 0, "kv_cache_usage": 0.0}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        app.state.bodies.append(request.headers.get(KV_HEADER))
        if not (await request.json()).get("stream"):
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)

        async def events():
            yield b'data: {"choices": [{"text": "x", "index": 0}]}\n\n'
            raise RuntimeError("the decode replica died")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_failing_decode_replica_gives_a_clear_error(live):
    stub = _broken_decode_replica()
    with serve_in_thread(stub) as d_url:
        app = build_router_app([live["prefill"], d_url], poll_interval_s=0.05, internal_key=KEY)
        with serve_in_thread(app) as r_url:
            wait_for(lambda: app.state.router.disaggregated(), 10, "both roles up")
            body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            r = httpx.post(r_url + "/v1/completions", json=body, trust_env=False, timeout=60)
            assert r.status_code == 500 and r.json()["error"]["message"] == "boom"
            with httpx.stream(
                "POST",
                r_url + "/v1/completions",
                json={**body, "stream": True},
                trust_env=False,
                timeout=60,
            ) as s:
                lines = [ln for ln in s.iter_lines() if ln.startswith("data:")]
            assert lines[0].startswith('data: {"choices"') and lines[-1] == "data: [DONE]"
            assert "failed while streaming" in lines[-2] and "replica_failed" in lines[-2]
            assert all(h and h.startswith("slimserve-kv-") for h in stub.state.bodies)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--role", "foo"], "--role 'foo': choose one of colocated, prefill, decode"),
        (["--role", "prefill", "-tp", "2"], "--role prefill cannot be combined with"),
        (
            ["--prefill-replicas", "2", "--data-parallel-size", "2"],
            "--prefill-replicas 2 needs --data-parallel-size of at least 3",
        ),
        (["--role", "decode", "--data-parallel-size", "2"], "use --prefill-replicas K"),
    ],
)
def test_serve_refuses_bad_role_flags(flags, message):
    from typer.testing import CliRunner

    from slimserve.runtime.cli import app

    r = CliRunner().invoke(app, ["serve", str(DEMO), *flags])
    assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output


def test_bench_passes_prefill_replicas_to_serve():
    from slimserve.runtime.bench.driver import BenchArgs, serve_command

    args = BenchArgs(model=str(DEMO), data_parallel_size=2, prefill_replicas=1)
    args.validate()
    cmd = serve_command(args, 8123)
    assert cmd[cmd.index("--data-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--prefill-replicas") + 1] == "1"
    with pytest.raises(
        ValueError, match="--prefill-replicas 2 needs --data-parallel-size of at least 3"
    ):
        BenchArgs(model=str(DEMO), data_parallel_size=2, prefill_replicas=2).validate()


# -- between hosts: segments moved over HTTP -----------------------------------------------------


def test_host_id_tells_whether_two_servers_share_the_segment_folder(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert host_id(a) == host_id(a) and host_id(a) != host_id(b)


@pytest.fixture(scope="module")
def two_hosts():
    """A prefill and a decode replica advertising different KV hosts, so the router moves the
    segments over HTTP (both folders are in fact this test's one, where every segment must be
    gone once moved and imported)."""
    with ExitStack() as stack:
        cfg = dict(model=str(DEMO), device="cpu", kv_cache_memory=8 * 2**20)
        p_url = stack.enter_context(
            serve_in_thread(
                build_app(
                    AsyncEngine(LLMEngine(EngineConfig(**cfg))),
                    role="prefill",
                    kv_host="host-a",
                    internal_key=KEY,
                ),
                60,
            )
        )
        d_url = stack.enter_context(
            serve_in_thread(
                build_app(
                    AsyncEngine(LLMEngine(EngineConfig(**cfg))),
                    role="decode",
                    kv_host="host-b",
                    internal_key=KEY,
                ),
                60,
            )
        )
        app = build_router_app([p_url, d_url], poll_interval_s=0.05, internal_key=KEY)
        r_url = stack.enter_context(serve_in_thread(app, 30))
        wait_for(lambda: app.state.router.disaggregated(), 10, "both roles up")
        yield {"prefill": p_url, "decode": d_url, "router": r_url}


def test_replicas_on_two_hosts_get_the_kv_over_http(two_hosts, kv_dir):
    direct = openai.OpenAI(base_url=two_hosts["prefill"] + "/v1", api_key="x", max_retries=0)
    routed = openai.OpenAI(base_url=two_hosts["router"] + "/v1", api_key="x", max_retries=0)
    model = routed.models.list().data[0].id
    kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    ref = direct.completions.create(**kw)
    assert routed.completions.create(**kw).choices[0].text == ref.choices[0].text
    parts = list(routed.completions.create(**kw, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == ref.choices[0].text
    two = routed.completions.create(**{**kw, "max_tokens": 5}, n=2)
    assert [c.text for c in two.choices] == [ref.choices[0].text[: len(two.choices[0].text)]] * 2
    listed = httpx.get(two_hosts["router"] + "/router/replicas", trust_env=False).json()
    assert {r["role"]: r["kv_host"] for r in listed["replicas"]} == {
        "prefill": "host-a",
        "decode": "host-b",
    }
    metrics = httpx.get(two_hosts["router"] + "/metrics", trust_env=False).text
    moved = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("slimserve_router:kv_relayed_bytes_total ")
    )
    assert "slimserve_router:kv_handovers_total 3.0" in metrics and moved > 4 * 4096
    assert not list(kv_dir.glob("slimserve-kv-*"))  # handed out, received, imported: all gone


def test_segment_endpoints_refuse_clearly(two_hosts, kv_dir):
    p, d = two_hosts["prefill"], two_hosts["decode"]

    def err(r, status):
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert (
        err(httpx.get(p + "/kv_segments/passwd", headers=IK, trust_env=False), 400)["code"]
        == "bad_kv_handle"
    )
    assert (
        err(httpx.get(p + f"/kv_segments/{new_name()}", headers=IK, trust_env=False), 410)["code"]
        == "kv_segment_missing"
    )
    assert (
        "needs `runtime serve --role prefill`"
        in err(httpx.get(d + f"/kv_segments/{new_name()}", headers=IK, trust_env=False), 400)[
            "message"
        ]
    )
    assert (
        err(httpx.post(p + "/kv_segments", content=MAGIC, headers=IK, trust_env=False), 400)["code"]
        == "wrong_role"
    )
    assert (
        "bad magic"
        in err(
            httpx.post(d + "/kv_segments", content=b"GIF89a" * 10, headers=IK, trust_env=False), 400
        )["message"]
    )
    too_big = MAGIC + bytes(6 * 2**20)  # the demo model's whole context is ~5 MB of KV
    assert (
        "more than"
        in err(
            httpx.post(
                d + "/kv_segments", content=too_big, headers=IK, trust_env=False, timeout=60
            ),
            400,
        )["message"]
    )
    assert not list(kv_dir.iterdir())  # nothing half-written left behind
    r = httpx.post(d + "/kv_segments", content=MAGIC + b"rest", headers=IK, trust_env=False)
    assert r.status_code == 201 and (kv_dir / r.json()["kv_segment"]).exists()  # then expires
    (kv_dir / r.json()["kv_segment"]).unlink()


def test_a_failed_move_between_hosts_is_a_clear_502(two_hosts):
    stub = FastAPI()

    @stub.get("/state")
    async def state():
        return {"role": "decode", "kv_host": "host-z", "num_running": 0, "kv_cache_usage": 0.0}

    @stub.post("/kv_segments")
    async def receive(request: Request):
        await request.body()
        return JSONResponse({"error": {"message": "no room", "type": "server_error"}}, 507)

    with serve_in_thread(stub) as d_url:
        app = build_router_app(
            [two_hosts["prefill"], d_url], poll_interval_s=0.05, internal_key=KEY
        )
        with serve_in_thread(app) as r_url:
            wait_for(lambda: app.state.router.disaggregated(), 10, "both roles up")
            r = httpx.post(
                r_url + "/v1/completions",
                json={"prompt": PROMPT, "max_tokens": 4},
                trust_env=False,
                timeout=60,
            )
    assert r.status_code == 502 and r.json()["error"]["code"] == "kv_relay_failed"
    assert f"to decode replica {d_url}: it answered 507: no room" in r.json()["error"]["message"]
