"""The router (runtime/router/): the routing policies as pure functions, and the proxy live in
front of two fake-engine replicas (tests/helpers/server_fakes.py) on real uvicorn ports: the
official openai client, client disconnects, replicas failing, added and removed at run time.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from slimserve.runtime.errors import EngineDeadError
from slimserve.runtime.router.app import build_router_app
from slimserve.runtime.router.policy import (
    CHUNK_CHARS,
    LeastLatency,
    Random,
    ReplicaState,
    RoundRobin,
    fleet_cost,
    ids_prompt,
    make_policy,
    new_tokens,
    predicted_ttft,
    prompt_info,
    reported_cost,
    text_prompt,
)
from slimserve.runtime.router.replicas import Replica
from slimserve.runtime.server.app import build_app
from slimserve.runtime.server.process import ServerSpec, free_port, launched_servers
from slimserve.runtime.stats.step_cost import StepCost
from tests.helpers.live_server import serve_in_thread, wait_for
from tests.helpers.server_fakes import FakeEngine, chat_messages

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are a careful assistant. " * 40  # > 4 chunks of CHUNK_CHARS


# -- policies ------------------------------------------------------------------------------------


def _replicas(n=2, **kw):
    return [ReplicaState(f"http://r{i}", **kw) for i in range(n)]


def test_least_latency_prefers_the_less_loaded_replica():
    a, b = _replicas(step_time_s=0.02, prefill_s_per_token=1e-3)
    a.queued_prefill_tokens = 2000
    assert LeastLatency().choose([a, b], text_prompt("hello")) is b
    b.num_running, b.queued_prefill_tokens = 0, 3000
    assert LeastLatency().choose([a, b], text_prompt("hello")) is a
    # a slower replica (measured) loses at equal queues
    a.queued_prefill_tokens = b.queued_prefill_tokens = 100
    a.prefill_s_per_token = 5e-3
    assert LeastLatency().choose([a, b], text_prompt("hello")) is b


def test_least_latency_prefers_the_replica_holding_the_prefix():
    a, b = _replicas(step_time_s=0.02, prefill_s_per_token=1e-3)
    prompt = text_prompt(SYSTEM + "question one")
    assert len(prompt.prefix_hashes) == 4
    b.prefixes.insert(text_prompt(SYSTEM + "another question").prefix_hashes)
    assert LeastLatency().choose([a, b], prompt) is b  # equal loads: the cached prefix wins
    assert predicted_ttft(b, prompt) < predicted_ttft(a, prompt)
    b.queued_prefill_tokens = 5000  # ... until its queue costs more than the prefix saves
    assert LeastLatency().choose([a, b], prompt) is a
    # a prompt sharing only the first chunk matches one chunk
    a2, b2 = _replicas(step_time_s=0.02, prefill_s_per_token=1e-3)
    b2.prefixes.insert(text_prompt("x" * CHUNK_CHARS + "y" * 3 * CHUNK_CHARS).prefix_hashes)
    assert (
        b2.prefixes.match(text_prompt("x" * CHUNK_CHARS + "z" * 3 * CHUNK_CHARS).prefix_hashes) == 1
    )
    assert LeastLatency().choose([a2, b2], text_prompt("x" * CHUNK_CHARS + "q" * 400)) is b2


def test_a_burst_between_polls_spreads_over_the_replicas():
    """No polled load at all: the router's own counters (updated at dispatch) spread the burst,
    and a first token frees the prefill share."""
    replicas = [Replica("http://r0"), Replica("http://r1"), Replica("http://r2")]
    for r in replicas:
        r.mark_up()
    policy, states = LeastLatency(), [r.state for r in replicas]
    tickets, chosen = [], []
    for i in range(6):
        prompt = text_prompt(f"request {i} " * 30)
        state = policy.choose(states, prompt)
        chosen.append(state.url)
        tickets.append(replicas[states.index(state)].dispatch(prompt))
    assert sorted(chosen) == sorted(["http://r0", "http://r1", "http://r2"] * 2)
    assert all(s.inflight == 2 and s.inflight_prefilling == 2 for s in states)
    tickets[0].first_token()
    tickets[0].done()
    tickets[0].done()  # idempotent
    s0 = replicas[0].state if chosen[0] == "http://r0" else None
    assert s0 is not None and (s0.inflight, s0.inflight_prefilling) == (1, 1)


def test_round_robin_cycles_and_skips_a_down_replica():
    a, b, c = _replicas(3)
    rr = RoundRobin()
    assert [rr.choose([a, b, c], text_prompt("x")) for _ in range(4)] == [a, b, c, a]
    b.up = False
    assert [rr.choose([a, b, c], text_prompt("x")) for _ in range(4)] == [c, a, c, a]


@pytest.mark.parametrize("policy", ["least-latency", "round-robin", "random"])
def test_a_down_replica_is_never_picked(policy):
    a, b = _replicas(2)
    a.up = False
    b.queued_prefill_tokens = 10**6  # far busier, but the only one up
    p = make_policy(policy)
    assert all(p.choose([a, b], text_prompt(SYSTEM)) is b for _ in range(20))
    b.up = False
    assert p.choose([a, b], text_prompt("x")) is None


def test_random_uses_every_replica_up():
    a, b, c = _replicas(3)
    rnd = Random(seed=0)
    assert {rnd.choose([a, b, c], text_prompt("x")).url for _ in range(60)} == {a.url, b.url, c.url}
    with pytest.raises(ValueError, match="least-latency, round-robin, random"):
        make_policy("fastest")


def test_kv_pressure_inflates_the_prediction():
    a, b = _replicas(step_time_s=0.02, prefill_s_per_token=1e-3)
    a.kv_cache_usage = 0.99
    assert predicted_ttft(a, text_prompt("x" * 400)) > 2 * predicted_ttft(b, text_prompt("x" * 400))
    assert LeastLatency().choose([a, b], text_prompt("x")) is b


COST = StepCost(0.01, 5e-4, 5e-4, 1e-5)


def test_least_latency_counts_the_decode_load_through_the_step_cost():
    """Equal prefill queues: the replica decoding long sequences steps slower (its attention
    reads more), which a moving average of past steps would only notice later."""
    a, b = _replicas(step_cost=COST)
    a.num_decoding, a.decoding_context_tokens = 16, 16 * 700
    b.num_decoding, b.decoding_context_tokens = 16, 16 * 100
    p = text_prompt("x" * 400)  # 100 tokens at the default 4 characters a token
    assert LeastLatency().choose([a, b], p) is b
    # by hand: one step decoding 16 rows of 700 tokens, plus 100 prefill tokens
    assert predicted_ttft(a, p) == pytest.approx(COST.step_s(0, 16, 16 * 700) + 100 * 5e-4)
    # a prefill longer than a step's budget (512 less the 16 decoding rows) takes two steps
    long = text_prompt("x" * 2400)  # 600 tokens
    b.max_num_batched_tokens = 512
    assert predicted_ttft(b, long) == pytest.approx(2 * COST.step_s(0, 16, 1600) + 600 * 5e-4)


def test_text_prompts_count_in_the_replicas_own_tokens():
    a, b = _replicas(step_cost=COST)
    a.chars_per_token = 2.0  # its tokenizer: 2 characters a token; b has not reported one
    p = text_prompt(SYSTEM + "q" * 400)
    assert new_tokens(a, p) == round(len(SYSTEM + "q" * 400) / 2) and new_tokens(b, p) == p.tokens
    a.prefixes.insert(p.prefix_hashes)  # 4 cached chunks of 256 characters: 512 of its tokens
    assert new_tokens(a, p) == round(len(SYSTEM + "q" * 400) / 2) - 4 * CHUNK_CHARS // 2
    r = Replica("http://r")
    r.mark_up()
    r.state.chars_per_token = 2.0
    assert r.dispatch(text_prompt("x" * 400)).prefill_tokens == 200


def test_the_polled_queue_drains_at_the_replicas_own_rate():
    r = Replica("http://r")
    r.mark_up()
    r.state_polled(
        {"queued_prefill_tokens": 1000, "step_cost": COST.as_dict(), "max_num_batched_tokens": 512},
        sent_at=time.monotonic(),
    )
    at, p = r.state.answered_at, text_prompt("x" * 400)
    rate = 512 / COST.step_s(512, 0, 0)  # prefill tokens a second with nothing decoding
    left = 1000 - 0.2 * rate
    assert predicted_ttft(r.state, p, now=at + 0.2) == pytest.approx(
        math.ceil((left + 100) / 512) * COST.step_s(0, 0, 0) + (left + 100) * 5e-4
    )
    idle = ReplicaState("http://idle", step_cost=COST)
    assert predicted_ttft(r.state, p, now=at + 10) == pytest.approx(predicted_ttft(idle, p))
    # what the router sent after the poll left is added whole, and decodes while this waits
    r.dispatch(text_prompt("y" * 800))
    assert predicted_ttft(r.state, p, now=at + 10) == pytest.approx(
        COST.step_s(0, 1, 200) + 300 * 5e-4
    )


def test_a_replica_without_a_fit_costs_the_fleet_mean():
    a, b, c = _replicas(3)
    a.step_cost, b.step_cost = COST, StepCost(0.03, 1.5e-3, 1.5e-3, 3e-5)
    mean = fleet_cost([a, b, c])
    assert mean.as_dict() == pytest.approx(StepCost(0.02, 1e-3, 1e-3, 2e-5).as_dict())
    assert predicted_ttft(c, text_prompt("x" * 400), mean) == pytest.approx(0.02 + 100 * 1e-3)
    # an older server's step time and prefill cost stand in for a fit
    c.step_time_s, c.prefill_s_per_token = 0.05, 2e-3
    assert reported_cost(c) == StepCost(0.05, 2e-3)
    assert fleet_cost([c]) == StepCost(0.05, 2e-3)


def test_state_polls_read_the_cost_and_tokenizer_fields():
    r = Replica("http://r")
    r.apply_state(
        {
            "step_cost": COST.as_dict(),
            "chars_per_token": 3.0,
            "num_decoding": 4,
            "decoding_context_tokens": 999,
        }
    )
    s = r.state
    assert (s.step_cost, s.chars_per_token, s.num_decoding, s.decoding_context_tokens) == (
        COST,
        3.0,
        4,
        999,
    )
    r.apply_state({"step_cost": {"base_s": -1}, "chars_per_token": 0})
    assert (s.step_cost, s.chars_per_token, s.num_decoding) == (None, None, 0)
    assert r.describe()["step_cost"] is None


def test_prompt_info_reads_completions_chat_and_token_ids():
    text = prompt_info({"prompt": SYSTEM}, chat=False)
    assert text.tokens == len(SYSTEM) // 4 and len(text.prefix_hashes) == 4
    assert prompt_info({"prompt": "short"}, chat=False).prefix_hashes == ()
    ids = prompt_info({"prompt": list(range(200))}, chat=False)
    assert ids.tokens == 200 and len(ids.prefix_hashes) == 3 and ids == ids_prompt(list(range(200)))
    chat = prompt_info(
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]},
        chat=True,
    )
    same_system = prompt_info(
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "bye"}]},
        chat=True,
    )
    assert chat.prefix_hashes == same_system.prefix_hashes  # the shared system prompt
    for junk in (None, [], {"prompt": 3}, {"messages": "x"}, {"messages": [1, {"content": 2}]}):
        assert prompt_info(junk, chat=isinstance(junk, dict) and "messages" in junk).tokens >= 1


# -- live: two fake replicas behind the router -----------------------------------------------------


@contextmanager
def _cluster(n=2, policy="round-robin", delay=0.01, internal_key=None, **router_kw):
    engines = [FakeEngine(delay=delay, max_model_len=4096) for _ in range(n)]
    with ExitStack() as stack:
        urls = [
            stack.enter_context(serve_in_thread(build_app(e, internal_key=internal_key)))
            for e in engines
        ]
        if internal_key is not None:
            router_kw["internal_key"] = internal_key
        router = build_router_app(urls, policy=policy, poll_interval_s=0.05, **router_kw)
        url = stack.enter_context(serve_in_thread(router))
        yield engines, urls, url, router.state.router


def test_replica_state_endpoint():
    engine = FakeEngine(max_model_len=4096)
    with serve_in_thread(build_app(engine)) as url:
        s = httpx.get(url + "/state", trust_env=False).json()
        assert s["healthy"] and s["num_running"] == 0 and s["queued_prefill_tokens"] == 0
        assert s["step_time_s"] == engine.delay and s["max_num_batched_tokens"] == 64
        engine.unhealthy = "stuck"
        r = httpx.get(url + "/state", trust_env=False)
        assert r.status_code == 503 and r.json()["problem"] == "stuck"
        engine.dead = True
        assert httpx.get(url + "/state", trust_env=False).json()["error"]["code"] == "engine_dead"


def test_openai_client_through_the_router():
    with _cluster(policy="round-robin") as (engines, _, url, router):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
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
        r = c.chat.completions.create(model="fake-model", messages=chat_messages(), max_tokens=2)
        assert r.choices[0].message.content == "ab" and r.choices[0].finish_reason == "length"
        parts = list(
            c.chat.completions.create(
                model="fake-model", messages=chat_messages(), max_tokens=3, stream=True
            )
        )
        assert "".join(p.choices[0].delta.content or "" for p in parts) == "abc"
        # the replicas' own errors come back unchanged
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="nope", prompt="hi")
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="fake-model", prompt="hi", temperature=-1)
        assert e.value.body["param"] == "temperature"
        assert [len(e.requests) for e in engines] == [2, 2]  # round-robin over both
        health = httpx.get(url + "/health", trust_env=False).json()
        assert health["replicas_up"] == 2
        metrics = httpx.get(url + "/metrics", trust_env=False).text
        assert 'slimserve_router:replica_up{replica="' in metrics
        assert "slimserve_router:requests_total" in metrics


def test_least_latency_spreads_concurrent_streams_and_keeps_prefixes_together():
    # Each stream lasts ~2 s (20 tokens x 0.1 s) and all six start together, so none ends
    # before the last is routed even on a loaded machine (at 0.4 s a stream, a late thread
    # once found a replica already free and the split came out 4/2).
    with _cluster(policy="least-latency", delay=0.1) as (engines, _, url, router):
        start = threading.Barrier(6)

        def one(prompt, max_tokens=20, barrier=None):
            with httpx.Client(timeout=30, trust_env=False) as c:
                if barrier is not None:
                    barrier.wait(timeout=30)
                r = c.post(
                    url + "/v1/completions",
                    json={"prompt": prompt, "max_tokens": max_tokens, "stream": True},
                )
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")

        threads = [threading.Thread(target=one, args=(f"q{i} " * 100, 20, start)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(len(e.requests) for e in engines) == [3, 3]
        # with both idle, follow-ups sharing a long prefix go where it went first
        for i in range(4):
            one(SYSTEM + f"question {i}", max_tokens=2)
        counts = [sum(1 for _, ids, _ in e.requests if len(ids) > len(SYSTEM)) for e in engines]
        assert sorted(counts) == [0, 4]


def test_client_disconnect_aborts_on_the_replica():
    with _cluster(n=1) as (engines, _, url, _router):
        engine = engines[0]
        with httpx.Client(base_url=url, timeout=10, trust_env=False) as c:
            with c.stream(
                "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 500, "stream": True}
            ) as r:
                first = json.loads(next(ln for ln in r.iter_lines() if ln)[len("data: ") :])
            wait_for(
                lambda: first["id"] in engine.closed_early or first["id"] in engine.abort_calls,
                what="the streamed request to be aborted on the replica",
            )
            n = len(engine.requests)
            with pytest.raises(httpx.ReadTimeout):  # non-streamed, abandoned while running
                c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500}, timeout=0.2)
            wait_for(lambda: len(engine.requests) > n)
            rid = engine.requests[n][0]
            wait_for(
                lambda: rid in engine.closed_early or rid in engine.abort_calls,
                what="the plain request to be aborted on the replica",
            )
        wait_for(lambda: _router.replicas.states()[0].inflight == 0, what="tickets closed")


def test_unhealthy_replica_fails_its_streams_at_once_and_gets_no_new_requests():
    with _cluster(policy="round-robin") as (engines, urls, url, router):
        results: dict[int, str] = {}
        ended: dict[int, float] = {}

        def one(i):
            with httpx.Client(timeout=20, trust_env=False) as c:
                results[i] = c.post(
                    url + "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 1000, "stream": True},
                ).text
                ended[i] = time.monotonic()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: all(len(e._aborts) == 2 for e in engines), what="streams running")
        engines[1].unhealthy = "an engine step has run for 400 s"  # /state answers 503
        wait_for(lambda: len(ended) >= 2, timeout=3, what="the failed streams to end")
        time.sleep(0.2)
        assert len(ended) == 2  # failed promptly, not after 1000 tokens (10 s); the others run on
        for i in ended:
            events = [ln for ln in results[i].split("\n\n") if ln]
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2][len("data: ") :])["error"]
            assert err["code"] == "replica_failed" and "400 s" in err["message"]
        assert not router.replicas.get(urls[1]).up
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            timeout=10,
            trust_env=False,
        )
        assert r.status_code == 200 and len(engines[1].requests) == 2
        engines[0].dead = True  # now nobody is up
        wait_for(lambda: not router.replicas.get(urls[0]).up, what="replica 0 out")
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10, trust_env=False)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
        assert httpx.get(url + "/health", trust_env=False).status_code == 503
        engines[0].dead = False
        engines[1].unhealthy = None  # both come back
        wait_for(lambda: all(r.up for r in router.replicas), what="replicas back")
        for t in threads:
            t.join(20)


def test_replicas_are_added_and_removed_at_run_time():
    with _cluster(n=1, admin_key="adm") as (engines, urls, url, router):
        extra = FakeEngine(max_model_len=4096)
        admin = {"Authorization": "Bearer adm"}
        with (
            serve_in_thread(build_app(extra)) as extra_url,
            httpx.Client(base_url=url, timeout=10, trust_env=False) as c,
        ):
            assert c.post("/router/replicas", json={"url": extra_url}).status_code == 401
            r = c.post("/router/replicas", json={"url": extra_url + "/"}, headers=admin)
            assert r.status_code == 201 and r.json()["up"] and r.json()["url"] == extra_url
            assert [x["url"] for x in c.get("/router/replicas").json()["replicas"]] == [
                urls[0],
                extra_url,
            ]
            for _ in range(4):
                assert (
                    c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code
                    == 200
                )
            assert len(extra.requests) == 2 and len(engines[0].requests) == 2
            assert c.delete("/router/replicas", params={"url": urls[0]}, headers=admin).json() == {
                "removed": urls[0]
            }
            assert (
                c.delete("/router/replicas", params={"url": urls[0]}, headers=admin).status_code
                == 404
            )
            for _ in range(2):
                c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert len(extra.requests) == 4 and len(engines[0].requests) == 2
            assert (
                c.post("/router/replicas", json={"url": "ftp://x"}, headers=admin).status_code
                == 400
            )
    with _cluster(n=1) as (_, _, url, _):  # no admin key: the list is fixed
        r = httpx.post(
            url + "/router/replicas", json={"url": "http://127.0.0.1:1"}, trust_env=False
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


@pytest.mark.timeout(90)
def test_killing_a_replica_mid_load_loses_no_unstarted_request_and_hangs_no_client(tmp_path):
    """One replica is a real process, SIGKILLed while streams run on both. Polling is slow here
    (30 s), so the router learns of the death only from the broken connections."""
    port = free_port()
    spec = ServerSpec(
        [sys.executable, "-m", "tests.helpers.fake_replica", str(port), "0.01"],
        f"http://127.0.0.1:{port}",
        {**os.environ, "PYTHONPATH": str(REPO)},
        tmp_path / "replica.log",
    )
    survivor = FakeEngine(delay=0.01, max_model_len=4096)
    with (
        launched_servers([spec], 60, die_with_parent=False) as (proc,),
        serve_in_thread(build_app(survivor)) as alive_url,
    ):
        app = build_router_app([spec.url, alive_url], policy="round-robin", poll_interval_s=30)
        with serve_in_thread(app) as url:
            results: dict[int, str] = {}
            started: dict[int, float] = {}

            def one(i, max_tokens=400):
                with httpx.Client(timeout=30, trust_env=False) as c:
                    with c.stream(
                        "POST",
                        url + "/v1/completions",
                        json={"prompt": "hi", "max_tokens": max_tokens, "stream": True},
                    ) as r:
                        assert r.status_code == 200
                        text = ""
                        for chunk in r.iter_text():
                            started.setdefault(i, time.monotonic())
                            text += chunk
                        results[i] = text

            threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            wait_for(lambda: len(started) == 6, what="6 streams running")
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            proc.wait(
                10
            )  # dead, not dying: a dying process may still accept a connection and cut it
            # requests sent now: the first that lands on the dead replica finds it refusing
            # connections and goes to the survivor, as does every later one
            with httpx.Client(timeout=30, trust_env=False) as c:
                for _ in range(4):
                    r = c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    assert r.status_code == 200, r.text
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads)
            failed = [i for i, text in results.items() if "replica_failed" in text]
            ok = [i for i, text in results.items() if "replica_failed" not in text]
            assert len(failed) == 3 and len(ok) == 3
            for i in failed:
                assert results[i].endswith("data: [DONE]\n\n")
            for i in ok:
                assert '"finish_reason":"length"' in results[i].replace(" ", "")
            assert time.monotonic() - killed < 15  # the survivor's streams take ~4 s
            assert len(survivor.requests) == 3 + 4
            state = app.state.router.replicas.get(spec.url)
            assert not state.up and state.state.inflight == 0


def test_reset_prefix_cache_reaches_every_replica_and_clears_the_affinity():
    ik = {"x-slimserve-internal-key": "k"}  # an admin call, on the router as on a replica
    with _cluster(policy="least-latency", internal_key="k") as (engines, _, url, router):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
        c.completions.create(model="fake-model", prompt="x" * 600, max_tokens=2)
        assert sum(len(r.state.prefixes) for r in router.replicas) > 0
        assert httpx.post(url + "/reset_prefix_cache", trust_env=False).status_code == 401
        assert [e.prefix_cache_resets for e in engines] == [0, 0]
        r = httpx.post(url + "/reset_prefix_cache", headers=ik, trust_env=False)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert [e.prefix_cache_resets for e in engines] == [1, 1]
        assert sum(len(r.state.prefixes) for r in router.replicas) == 0

        async def refuse():  # up and polled healthy, but its reset answers 503
            raise EngineDeadError("the engine stopped")

        engines[1].reset_prefix_cache = refuse
        r = httpx.post(url + "/reset_prefix_cache", headers=ik, trust_env=False)
        assert r.status_code == 502 and r.json()["status"] == "failed"
        assert engines[0].prefix_cache_resets == 2


def test_load_counts_only_the_prefill_left_to_compute():
    """GET /state's queued_prefill_tokens (what least-latency reads) leaves out the prompt
    tokens the prefix cache serves and those chunked prefill has computed: a replica holding
    a shared prefix must not look busier than it is."""
    from slimserve.runtime.config import EngineConfig
    from slimserve.runtime.engine.async_engine import AsyncEngine
    from slimserve.runtime.engine.llm_engine import LLMEngine
    from slimserve.runtime.engine.sequence import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(REPO / "recipes" / "demo-model"),
            device="cpu",
            kv_cache_memory=8 * 2**20,
            max_num_batched_tokens=32,
        )
    )
    ae = AsyncEngine(engine)
    prefix = list(range(10, 106))  # 96 tokens: 6 blocks of 16
    engine.add_request("a", prefix + [7], SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", prefix + list(range(200, 244)), SamplingParams(max_tokens=1))
    ae._snapshot_load()
    assert ae._left == {"b": 140 - 96}  # waiting: its cached prefix is not work
    engine.step()  # admitted: the prefix from the cache, then a 32-token chunk
    ae._snapshot_load()
    assert ae._left == {"b": 140 - 96 - 32}
    ae._prefill = {"b": 140, "queued": 50}
    assert ae.load().queued_prefill_tokens == 12 + 50  # not yet handed over: all of it


def test_queued_work_is_the_poll_plus_what_was_sent_after_it():
    """A long prompt mostly computed by chunked prefill counts as what the replica reports left,
    not as its whole length until its first token (that made least-latency pile short requests
    onto the other replica); what the router sent after the poll left is added."""
    busy, idle = Replica("http://busy"), Replica("http://idle")
    for r in (busy, idle):
        r.mark_up()
        r.state.step_time_s, r.state.prefill_s_per_token = 0.02, 1e-3
    long = busy.dispatch(text_prompt("y" * 3200))  # 800 tokens
    assert predicted_ttft(busy.state, text_prompt("x" * 400)) > 0.8  # no poll yet: all of it
    speed = {"step_time_s": 0.02, "prefill_s_per_token": 1e-3}
    busy.state_polled({"queued_prefill_tokens": 50, **speed}, sent_at=time.monotonic())
    idle.state_polled({"queued_prefill_tokens": 0, **speed}, sent_at=time.monotonic())
    assert busy.state.prefill_sent_since_poll == 0  # the poll saw it: 50 tokens are left
    short = idle.dispatch(text_prompt("x" * 400))  # sent after the poll: added to it
    assert idle.state.prefill_sent_since_poll == 100
    other = text_prompt("z" * 400)  # no prefix either holds
    at = busy.state.answered_at  # as the poll answered: nothing prefilled since
    assert predicted_ttft(busy.state, other, now=at) == pytest.approx(0.02 + (50 + 100) * 1e-3)
    assert predicted_ttft(idle.state, other, now=at) == pytest.approx(0.02 + (100 + 100) * 1e-3)
    short.first_token()
    assert idle.state.prefill_sent_since_poll == 0
    long.done()
    assert busy.state.inflight_prefill_tokens == 0 and busy.state.prefill_sent_since_poll == 0
