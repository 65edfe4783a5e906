"""eval/gpu_check.py --dry-run: the GPU session's one command runs its whole plan on the CPU at
tiny shapes (kernels through the Triton interpreter) and writes a complete report, so it still
works the day a GPU is lent."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(400)


def test_dry_run_measures_every_configuration(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "slimserve.eval.gpu_check", "--dry-run",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=380)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["steps"]["kernels"].startswith("ok")
    configs = {(r["weights"], r["kv"], r["graphs"]) for r in report["decode"]}
    assert configs == {(w, kv, g) for w in ("bf16", "W4A16", "W8A8") for kv in ("bf16", "fp8")
                       for g in ("off", "static")}  # "static": graph buffers, not captured (CPU)
    for r in report["decode"]:
        assert r["tok_s"] > 0 and 0 < r["roofline_share"] < 1, r
    assert [r["batch"] for r in report["transformers"]] == [2] and report["transformers"][0]["tok_s"] > 0
    assert "| weights | KV | batch | graphs |" in proc.stdout
    assert (tmp_path / "kernel_bench.json").exists()
