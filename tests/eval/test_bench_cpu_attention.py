"""eval/bench_cpu_attention.py runs at a small shape, writes its JSON, and refuses bad flags in
one line."""

from __future__ import annotations

import json

import pytest

from slimserve.eval import bench_cpu_attention as bench
from slimserve.kernels import cpu_attention

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler here")


@needs_kernel
def test_runs_hot_and_cold_and_writes_json(tmp_path, capsys):
    out = tmp_path / "attn.json"
    bench.main(
        ["--seqs", "5", "--context", "20", "--layers", "2", "--runs", "2", "--kv", "bf16", "fp8"]
        + ["--json-out", str(out)]
    )
    data = json.loads(out.read_text())
    assert [r["kv"] for r in data["rows"]] == ["bf16", "fp8"]
    for r in data["rows"]:
        assert len(r["cold"]["runs"]) == 2 and r["hot"]["median_us"] > 0
    assert "| bf16 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,match",
    [(["--kv", "int3"], "--kv: int3 unknown"), (["--heads", "9", "2"], "--heads 9 2")],
)
def test_refuses_bad_flags(argv, match):
    with pytest.raises(SystemExit, match=match):
        bench.main(argv)
