"""Engine step timing and profiling: the per-phase and batch histograms in /metrics (the demo
model served in-process), the CUDA-event accounting with fake events, POST /start_profile and
/stop_profile writing a Chrome trace, their errors, `runtime serve --profile-dir` checks, and
`runtime bench`'s breakdown parser and --profile run."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from slimserve.runtime.bench.breakdown import parse_step_totals, scrape_step_totals, step_breakdown
from slimserve.runtime.bench.driver import BenchArgs, run_bench, serve_command
from slimserve.runtime.bench.report import format_breakdown
from slimserve.runtime.bench.workload import LengthDist
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.async_engine import AsyncEngine
from slimserve.runtime.server.app import build_app
from slimserve.runtime.server.metrics import STEP_PHASE_SECONDS
from slimserve.runtime.server.trust import INTERNAL_KEY_HEADER
from slimserve.runtime.stats.profiler import prepare_profile_dir
from slimserve.runtime.stats.step_timing import PHASES, StepTimings, split_gpu_forward
from tests.helpers import DEMO_MODEL
from tests.helpers.live_server import serve_in_thread
from tests.helpers.metrics_text import step_metrics
from tests.helpers.server_fakes import FakeEngine

pytestmark = pytest.mark.timeout(120)
_rng = random.Random(17)


def fresh_prompt(n: int) -> list[int]:
    """n token ids no earlier prompt starts with (no prefix-cache hit changes the counts)."""
    return [_rng.randrange(10, 2000) for _ in range(n)]


KEY = "test-internal-key"  # the admin endpoints need it (runtime/server/trust.py)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    profiles = tmp_path_factory.mktemp("profiles")
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=str(DEMO_MODEL),
            device="cpu",
            dtype="float32",
            max_num_seqs=8,
            kv_cache_memory="16MiB",
        ),
        profile_dir=profiles,
    )
    with serve_in_thread(build_app(engine, internal_key=KEY)) as url:
        with httpx.Client(
            base_url=url, timeout=60, trust_env=False, headers={INTERNAL_KEY_HEADER: KEY}
        ) as client:
            yield client, profiles


def complete(client: httpx.Client, prompt: list[int], max_tokens: int) -> None:
    r = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


# -- step histograms -------------------------------------------------------------------------------


def test_step_histograms_in_metrics_count_the_steps(served):
    client, _ = served
    before = parse_step_totals(client.get("/metrics").text)
    complete(client, fresh_prompt(12), 5)  # one prefill step (12 tokens) + 4 decode steps
    text = client.get("/metrics").text
    after = parse_step_totals(text)
    assert before is not None and after is not None
    for phase in PHASES:
        (s0, c0), (s1, c1) = before[f"phase:{phase}"], after[f"phase:{phase}"]
        assert c1 - c0 == 5, phase
        assert s1 - s0 >= 0, phase
    assert after["phase:forward"][0] > before["phase:forward"][0]
    prefill = [
        a - b
        for a, b in zip(
            after["slimserve:step_prefill_tokens"], before["slimserve:step_prefill_tokens"]
        )
    ]
    rows = [
        a - b
        for a, b in zip(after["slimserve:step_decode_rows"], before["slimserve:step_decode_rows"])
    ]
    assert prefill == [12, 5] and rows == [4, 5]  # (sum, count)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    phases = families[STEP_PHASE_SECONDS]
    assert phases.type == "histogram"
    assert {s.labels["phase"] for s in phases.samples} == set(PHASES)
    for phase in PHASES:  # cumulative buckets that end at the count
        buckets = [
            s for s in phases.samples if s.name.endswith("_bucket") and s.labels["phase"] == phase
        ]
        values = [s.value for s in buckets]
        assert values == sorted(values) and buckets[-1].labels["le"] == "+Inf"
        assert buckets[0].labels["le"] == "1e-05" and len(buckets) == 20
        assert values[-1] == after[f"phase:{phase}"][1]


def test_cuda_forward_is_timed_by_events_read_when_ready():
    class FakeEvent:
        clock = 0.0  # ms of the fake GPU timeline
        done = True

        def record(self):
            self.at = FakeEvent.clock

        def query(self):
            return FakeEvent.done

        def elapsed_time(self, end):
            return end.at - self.at

    assert split_gpu_forward(0.001, 0.009, 0.008) == (0.008, pytest.approx(0.002))
    assert split_gpu_forward(0.004, 0.001, 0.002) == (0.004, 0.001)  # launch-bound: host time
    timings = StepTimings(cuda=True, event_factory=FakeEvent)

    def step(gpu_ms: float, ready: bool):
        FakeEvent.done = ready
        clock = timings.begin()
        for phase in PHASES[1:]:
            if phase == "sample":
                FakeEvent.clock += gpu_ms  # the forward ran this long on the fake GPU
            clock.next(phase)
        clock.finish(3, 1)

    step(5000.0, ready=False)  # events not complete: forward and sample wait for a later step
    snap = timings.snapshot()
    assert snap.phases["schedule"].count == 1 and snap.phases["forward"].count == 0
    step(7000.0, ready=True)  # both steps' events are complete now
    snap = timings.snapshot()
    assert snap.phases["forward"].count == 2 and snap.phases["sample"].count == 2
    assert snap.phases["forward"].sum == pytest.approx(12.0)  # GPU time, longer than the host's
    assert snap.phases["sample"].sum == 0.0  # host time of forward + sample was all GPU wait
    assert snap.steps == 2 and snap.prefill_tokens.sum == 6 and snap.decode_rows.sum == 2
    assert len(timings._free_events) == 4  # events are reused
    import torch

    gpu = StepTimings.for_device(torch.device("cuda", 1))
    assert gpu.cuda and gpu.device == torch.device("cuda", 1)
    assert not StepTimings.for_device(torch.device("cpu")).cuda


# -- profiler endpoints ----------------------------------------------------------------------------


def _one_line_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert needle in message and "\n" not in message, message


def test_profile_writes_a_chrome_trace_with_the_phase_ranges(served):
    client, profiles = served
    _one_line_error(client.post("/stop_profile"), 409, "no profile is running")
    r = client.post("/start_profile")
    assert r.status_code == 200 and r.json()["status"] == "profiling", r.text
    _one_line_error(client.post("/start_profile"), 409, "already running")
    complete(client, fresh_prompt(9), 3)
    r = client.post("/stop_profile")
    assert r.status_code == 200, r.text
    body = r.json()
    assert "/" not in body["path"]  # a file name in the --profile-dir, no server path
    path = profiles / body["path"]
    assert path.name.endswith(".trace.json")
    assert body["steps"] >= 3 and body["capped"] is False
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for phase in PHASES:
        assert f"slimserve.{phase}" in names, phase
    forward = sorted(
        (e for e in trace["traceEvents"] if e.get("name") == "slimserve.forward"),
        key=lambda e: e["ts"],
    )
    assert len(forward) == body["steps"] and all(e["ph"] == "X" and e["dur"] > 0 for e in forward)
    steps = sorted(
        (e for e in trace["traceEvents"] if e.get("name") == "slimserve.step"),
        key=lambda e: e["ts"],
    )
    assert len(steps) == body["steps"]
    assert all(
        s["ts"] <= f["ts"] and f["ts"] + f["dur"] <= s["ts"] + s["dur"]
        for s, f in zip(steps, forward)
    )  # each step's range holds its forward
    _one_line_error(client.post("/stop_profile"), 409, "no profile is running")


def test_profile_stops_itself_at_its_step_cap(served):
    client, profiles = served
    r = client.post("/start_profile", json={"max_steps": 2, "record_shapes": False})
    assert r.status_code == 200 and r.json()["max_steps"] == 2, r.text
    complete(client, fresh_prompt(7), 5)  # 5 steps: the profile stopped after 2
    body = client.post("/stop_profile").json()
    assert body["capped"] is True and body["steps"] == 2
    names = [
        e.get("name") for e in json.loads((profiles / body["path"]).read_text())["traceEvents"]
    ]
    assert names.count("slimserve.forward") == 2
    _one_line_error(client.post("/stop_profile"), 409, "no profile is running")


def test_max_steps_is_clamped_to_the_server_cap_and_old_traces_are_rotated(served):
    from slimserve.runtime.stats.profiler import PROFILE_KEEP_TRACES, PROFILE_MAX_STEPS

    client, profiles = served
    r = client.post("/start_profile", json={"max_steps": 10**9})
    assert r.status_code == 200 and r.json()["max_steps"] == PROFILE_MAX_STEPS, r.text
    assert client.post("/stop_profile").status_code == 200
    (profiles / "notes.txt").write_text("not a trace: never removed")
    for _ in range(PROFILE_KEEP_TRACES + 1):
        assert client.post("/start_profile").status_code == 200
        last = client.post("/stop_profile").json()["path"]
    traces = sorted(p.name for p in profiles.glob("*.trace.json"))
    assert len(traces) == PROFILE_KEEP_TRACES and last in traces  # the newest kept
    assert (profiles / "notes.txt").exists()


def test_admin_endpoints_need_the_internal_key(served):
    client, _ = served
    for route in ("/start_profile", "/stop_profile", "/reset_prefix_cache"):
        r = client.post(route, headers={INTERNAL_KEY_HEADER: "wrong"})
        _one_line_error(r, 401, "missing or incorrect X-Slimserve-Internal-Key")
    with TestClient(build_app(FakeEngine())) as c:  # started without one: refused outright
        for route in ("/start_profile", "/stop_profile", "/reset_prefix_cache"):
            _one_line_error(c.post(route), 403, "start it with --internal-key")


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"max_steps": 0}, "max_steps: 0 must be an integer >= 1"),
        ({"max_steps": "10"}, "max_steps: '10'"),
        ({"record_shapes": "yes"}, "record_shapes: 'yes' is not true or false"),
        ({"steps": 3}, "steps: unknown field"),
        ([1], "must be a JSON object"),
    ],
)
def test_start_profile_refuses_bad_bodies(served, body, needle):
    client, _ = served
    _one_line_error(client.post("/start_profile", json=body), 400, needle)


def test_profiling_off_without_profile_dir():
    with TestClient(build_app(FakeEngine(), internal_key=KEY)) as c:
        for route in ("/start_profile", "/stop_profile"):
            _one_line_error(
                c.post(route, headers={INTERNAL_KEY_HEADER: KEY}),
                400,
                "start the server with --profile-dir",
            )
        text = c.get("/metrics").text  # the step histograms render, empty
        assert 'slimserve:step_phase_seconds_count{phase="forward"} 0.0' in text
    with TestClient(build_app(FakeEngine(), api_key="k", internal_key=KEY)) as c:
        # an admin endpoint: the client's API key is not its credential
        assert c.post("/start_profile", headers={"Authorization": "Bearer k"}).status_code == 401


def test_serve_profile_dir_is_created_or_refused_in_one_line(tmp_path):
    from slimserve.runtime import cli

    made = prepare_profile_dir(tmp_path / "a" / "b")
    assert made.is_dir() and not any(made.iterdir())
    (tmp_path / "file").write_text("")
    r = CliRunner().invoke(
        cli.app, ["serve", str(DEMO_MODEL), "--profile-dir", str(tmp_path / "file" / "sub")]
    )
    assert r.exit_code == 2 and "--profile-dir" in r.output and "not a writable folder" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


# -- runtime bench ---------------------------------------------------------------------------------

BEFORE = step_metrics(
    10, {"schedule": 0.01, "forward": 0.5}, prefill_tokens=300.0, decode_rows=20.0
)
AFTER = step_metrics(
    30, {"schedule": 0.03, "forward": 1.29}, prefill_tokens=500.0, decode_rows=100.0
)


def test_breakdown_from_a_metrics_pair():
    b = step_breakdown(parse_step_totals(BEFORE), parse_step_totals(AFTER))
    assert b["steps"] == 20 and b["step_time_s"] == pytest.approx(0.81)
    rows = {p["phase"]: p for p in b["phases"]}
    assert list(rows) == ["schedule", "forward"]  # the phases the server exports, in step order
    assert rows["forward"]["total_s"] == pytest.approx(0.79)
    assert rows["forward"]["ms_per_step"] == pytest.approx(39.5)
    assert rows["forward"]["share"] == pytest.approx(0.79 / 0.81)
    assert b["mean_prefill_tokens"] == pytest.approx(10.0) and b["mean_decode_rows"] == 4.0
    assert format_breakdown({"request_rate": 1.0, "step_breakdown": b}).row_count == 2


def test_no_breakdown_without_the_step_metrics():
    other = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"
    assert parse_step_totals(other) is None and parse_step_totals("<html>not metrics") is None
    assert step_breakdown(None, parse_step_totals(AFTER)) is None
    assert format_breakdown({"request_rate": 1.0, "step_breakdown": None}) is None
    app = FastAPI()  # a server without /metrics
    with serve_in_thread(app) as url:
        assert scrape_step_totals(url) is None
    assert scrape_step_totals("http://127.0.0.1:9") is None  # nothing listening


def test_bench_profile_and_breakdown_against_a_live_server(served, tmp_path, capsys):
    client, profiles = served
    args = BenchArgs(
        url=str(client.base_url).rstrip("/"),
        tokenizer=str(DEMO_MODEL),
        num_prompts=3,
        input_len=LengthDist(16, 0.2, 8, 24),
        output_len=LengthDist(4, 0.2, 2, 6),
        max_concurrency=2,
        profile=True,
        progress=False,
        internal_key=KEY,
        json_out=str(tmp_path / "b.json"),
    )
    result = run_bench(args)
    run = result["runs"][0]
    assert run["completed"] == 3
    b = run["step_breakdown"]
    assert b["steps"] >= max(r["output_tokens"] for r in run["requests"])
    assert sum(p["share"] for p in b["phases"]) == pytest.approx(1.0)
    assert [p["phase"] for p in b["phases"]] == list(PHASES)
    trace = profiles / run["profile_trace"]  # a --url server's trace: its name in its folder
    assert run["profile_steps"] == b["steps"]
    assert "slimserve.sample" in trace.read_text()
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["runs"][0]["step_breakdown"]["steps"] == b["steps"]
    out = capsys.readouterr().out
    assert "engine steps, rate inf" in out and "profile trace, rate inf" in out
    assert "omitted" not in out


def test_bench_profile_against_a_server_without_profile_dir_is_one_line():
    import typer

    from slimserve.runtime.bench.driver import bench_main

    app = typer.Typer()
    app.command("bench")(bench_main)
    app.command("other")(lambda: None)
    with serve_in_thread(build_app(FakeEngine(), internal_key=KEY)) as url:
        r = CliRunner().invoke(
            app,
            [
                "bench",
                "--url",
                url,
                "--internal-key",
                KEY,
                "--tokenizer",
                str(DEMO_MODEL),
                "--num-prompts",
                "2",
                "--input-len-median",
                "8",
                "--input-len-min",
                "4",
                "--input-len-max",
                "12",
                "--output-len-median",
                "2",
                "--output-len-min",
                "1",
                "--output-len-max",
                "3",
                "--profile",
                "--no-progress",
            ],
            terminal_width=400,
        )
    assert r.exit_code == 2, r.output
    assert "start_profile answered HTTP 400: profiling is off" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_bench_serves_model_with_a_profile_dir(tmp_path):
    args = BenchArgs(model="m", profile_dir=str(tmp_path / "p"))
    assert serve_command(args, 1)[-2:] == ["--profile-dir", str(tmp_path / "p")]
    assert "--profile-dir" not in serve_command(BenchArgs(model="m"), 1)


# -- POST /reset_prefix_cache (what runtime bench and runtime tune call before each run) -----------


def test_reset_prefix_cache_makes_a_repeated_prompt_prefill_again(served):
    client, _ = served
    prompt = fresh_prompt(48)  # three full 16-token blocks

    def prefilled() -> int:
        before = parse_step_totals(client.get("/metrics").text)
        complete(client, prompt, 2)
        after = parse_step_totals(client.get("/metrics").text)
        return int(
            after["slimserve:step_prefill_tokens"][0] - before["slimserve:step_prefill_tokens"][0]
        )

    assert prefilled() == 48
    assert prefilled() < 48  # its full blocks come from the prefix cache
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert prefilled() == 48
