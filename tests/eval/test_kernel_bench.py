"""eval/kernels/bench.py: the CPU smoke run (no CUDA: correctness at tiny shapes through the Triton
interpreter, timings skipped) reports PASS for every kernel, and the pure helpers that turn a
tile sweep into a dispatch table (eval/kernels/sweep.py) pick, merge and print as documented."""

import json
import os
import subprocess
import sys

import pytest

from slimserve.eval.kernels import bench as kb
from slimserve.eval.kernels import sweep

KERNELS = {
    "w4a16_gemm",
    "dequantize_w4a16",
    "act_quant",
    "w8a8_gemm",
    "linear_w8a8",
    "paged_attention_decode",
    "paged_attention_prefill",
    "write_kv_cache",
    "rope_and_write_kv",
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
}


def test_quick_cpu_run_reports_pass_for_every_kernel(tmp_path):
    out = tmp_path / "kernel_bench.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "slimserve.eval.kernels.bench", "--quick", "--json-out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "No CUDA device" in proc.stdout and "timings and e2e skipped" in proc.stdout
    assert "FAIL" not in proc.stdout, log[-4000:]
    summary = proc.stdout.split("== Summary ==")[1]
    assert {ln.split()[1] for ln in summary.splitlines() if ln.startswith("PASS")} == KERNELS

    report = json.loads(out.read_text())
    checks = [c for sec in report["results"].values() for c in sec["correctness"]]
    assert {c["kernel"] for c in checks} == KERNELS
    assert all(c["ok"] for c in checks)
    assert not any(sec["tables"] for sec in report["results"].values())  # no timings on CPU


def test_suggest_picks_lowest_geomean_slowdown_and_merges_equal_neighbours():
    p1, p16, p64, p256 = (1, 8, 8), (16, 8, 8), (64, 8, 8), (256, 8, 8)
    times = {
        p1: {"a": 10.0, "b": 12.0},
        p16: {"a": 11.0, "b": 10.0},
        p64: {"a": 20.0, "b": 10.0, "c": 9.0},
        p256: {"b": 30.0, "c": 20.0},
    }
    picks = sweep.suggest(times, [(16, [p1, p16]), (64, [p64]), (512, []), (None, [p256])])
    # bucket 16: a is 1.0x and 1.1x of best (geo 1.049), b is 1.2x and 1.0x (geo 1.095)
    assert [(p["bound"], p["config"]) for p in picks] == [
        (16, "a"),
        (64, "c"),
        (512, None),
        (None, "c"),
    ]
    assert picks[0]["geo_slowdown"] == pytest.approx(1.1**0.5)
    assert picks[0]["worst_slowdown"] == pytest.approx(1.1)
    merged = sweep.suggest(times, [(16, [p1, p16]), (64, [p64]), (None, [p256])])
    assert [(p["bound"], p["config"]) for p in merged] == [(16, "a"), (None, "c")]


def test_sweep_points_keep_valid_timings_and_compare_the_default():
    base = {"M": 4, "N": 8, "K": 16}
    records = [
        {**base, "config": "dflt", "default": True, "us": 10.0},
        {**base, "config": "wrong", "default": False, "us": 1.0, "valid": False},
        {**base, "config": "fast", "default": False, "us": 9.5, "valid": True},
        {**base, "config": "boom", "default": False, "error": "OutOfResources"},
        {**base, "config": "late", "default": False, "skipped": "time limit"},
    ]
    times, rows = sweep._sweep_points(records)
    assert times == {(4, 8, 16): {"dflt": 10.0, "fast": 9.5}}
    assert rows == [
        {
            **base,
            "best_us": 9.5,
            "default_us": 10.0,
            "ratio": 10.0 / 9.5,
            "within_10pct": True,
            "best": "fast",
        }
    ]


def test_config_repr_pastes_back_to_the_same_config():
    from slimserve.kernels.w4a16_gemm import DISPATCH, W4A16Config
    from slimserve.kernels.w8a8_gemm import CONFIGS, W8A8Config

    scope = {"W4A16Config": W4A16Config, "W8A8Config": W8A8Config}
    for cfg in [c for _, c in DISPATCH] + [c for _, c in CONFIGS]:
        assert eval(sweep.cfg_repr(cfg), scope) == cfg


def test_unknown_section_is_one_clear_line(capsys):
    assert kb.main(["--sections", "w4a16,gemv"]) == 2
    assert "--sections gemv unknown" in capsys.readouterr().out
