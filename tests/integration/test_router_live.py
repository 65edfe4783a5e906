"""`runtime serve --data-parallel-size 2` on CPU with the demo model: two engine processes behind
the router serve the official openai client, and stopping the parent stops the replicas."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from slimserve.runtime.server.process import (
    ServerSpec,
    free_port,
    start_server,
    stop_servers,
    wait_ready,
)

pytestmark = pytest.mark.timeout(240)
DEMO = Path(__file__).resolve().parents[2] / "recipes" / "demo-model"


def _start_data_parallel(tmp_path, *flags: str):
    """`runtime serve DEMO --data-parallel-size 2 FLAGS` started and ready: (process, spec);
    the caller stops it. One that does not come up is stopped here and the error raised."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "slimserve.runtime.cli",
        "serve",
        str(DEMO),
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--kv-cache-memory",
        "32MiB",
        *flags,
    ]
    spec = ServerSpec(
        cmd, f"http://127.0.0.1:{port}", {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path / "dp.log"
    )
    proc = start_server(spec)
    try:
        wait_ready(proc, spec, time.monotonic() + 200)
    except BaseException:
        stop_servers([proc])
        raise
    return proc, spec


def test_data_parallel_serve_behind_the_router(tmp_path):
    proc, spec = _start_data_parallel(tmp_path, "--max-num-seqs", "8")
    try:
        replicas = httpx.get(spec.url + "/router/replicas", trust_env=False).json()["replicas"]
        assert len(replicas) == 2 and all(r["up"] for r in replicas)
        assert all(r["step_time_s"] is None or r["step_time_s"] > 0 for r in replicas)
        c = openai.OpenAI(base_url=spec.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        r = c.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
        again = c.completions.create(
            model=model, prompt="def add(a, b):", max_tokens=8, temperature=0
        )
        assert again.choices[0].text == r.choices[0].text  # greedy: same tokens on either replica
        parts = list(
            c.completions.create(
                model=model, prompt="import os", max_tokens=6, temperature=0, stream=True
            )
        )
        assert parts and parts[-1].choices[0].finish_reason == "length"
        chat = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
        replicas = httpx.get(spec.url + "/router/replicas", trust_env=False).json()["replicas"]
        assert all(r["dispatched"] >= 1 for r in replicas)  # idle ties go to the one used less
        proc.send_signal(signal.SIGTERM)  # as systemd / docker stop do
        assert proc.wait(60) == 128 + signal.SIGTERM  # after a clean stop
        for r in replicas:  # no orphans: every replica's port is closed
            with pytest.raises(httpx.ConnectError):
                httpx.get(r["url"] + "/health", trust_env=False, timeout=2)
    finally:
        stop_servers([proc])
        log = spec.log_path.read_text(errors="replace") if spec.log_path.exists() else ""
        print(log[-3000:])


@pytest.mark.slow
def test_data_parallel_serve_disaggregated(tmp_path):
    """`--data-parallel-size 2 --prefill-replicas 1`: one prefill and one decode replica behind
    the router give the tokens of one colocated engine (its own replica, asked directly)."""
    proc, spec = _start_data_parallel(tmp_path, "--prefill-replicas", "1")
    try:
        deadline = time.monotonic() + 10
        while True:
            replicas = httpx.get(spec.url + "/router/replicas", trust_env=False).json()["replicas"]
            if sorted(r["role"] for r in replicas if r["up"]) == ["decode", "prefill"]:
                break
            assert time.monotonic() < deadline, replicas
            time.sleep(0.2)
        prefill = next(r["url"] for r in replicas if r["role"] == "prefill")
        body = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
        direct = httpx.post(prefill + "/v1/completions", json=body, trust_env=False, timeout=60)
        routed = httpx.post(spec.url + "/v1/completions", json=body, trust_env=False, timeout=60)
        assert routed.status_code == 200, routed.text
        assert routed.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
        metrics = httpx.get(spec.url + "/metrics", trust_env=False).text
        assert "slimserve_router:kv_handovers_total 1.0" in metrics
    finally:
        stop_servers([proc])
        log = spec.log_path.read_text(errors="replace") if spec.log_path.exists() else ""
        print(log[-3000:])
