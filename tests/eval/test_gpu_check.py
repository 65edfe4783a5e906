"""eval/gpu_check.py --dry-run: the GPU session's one command runs its whole plan on the CPU at
tiny shapes (kernels through the Triton interpreter) and writes a complete report, so it still
works the day a GPU is lent."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(460)


def test_dry_run_measures_every_configuration(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "slimserve.eval.gpu_check", "--dry-run", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=440,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["steps"]["kernels"].startswith("ok")
    configs = {(r["weights"], r["kv"], r["graphs"]) for r in report["decode"]}
    assert configs == {
        (w, kv, g)
        for w in ("bf16", "W4A16", "W8A8")
        for kv in ("bf16", "fp8")
        for g in ("off", "static")
    }  # "static": graph buffers, not captured (CPU)
    for r in report["decode"]:
        assert r["tok_s"] > 0 and 0 < r["roofline_share"] < 1, r
    assert [r["batch"] for r in report["transformers"]] == [2] and report["transformers"][0][
        "tok_s"
    ] > 0
    assert "| weights | KV | batch | graphs |" in proc.stdout
    assert (tmp_path / "kernel_bench.json").exists()
    tp = report["tensor_parallel"]  # TP=1 from the decode rows, TP=2 over two CPU processes
    assert report["steps"]["tp"].startswith("ok") and "dry run: TP=2" in tp["note"]
    assert [(r["tp"], r["batch"]) for r in tp["rows"]] == [(1, 2), (2, 2)], tp
    two = tp["rows"][1]
    assert two["tok_s"] > 0 and two["comm_calls_per_step"] > 0 and two["comm_ms_per_step"] > 0
    assert "Tensor parallelism | dry run: TP=2" in proc.stdout
    # the paged decode kernel alone over bf16 / fp8 / int8 / int4 caches (fp16 in the dry run)
    assert report["steps"]["kvdecode"].startswith("ok")
    kv = [(r["ctx"], r["kv"]) for r in report["kv_decode"]]
    assert kv == [(c, k) for c in (40, 100) for k in ("bf16", "fp8", "int8", "int4")]
    assert all(r["us"] > 0 and r["bytes_read"] > 0 for r in report["kv_decode"])
    int4, bf16 = report["kv_decode"][3], report["kv_decode"][0]
    assert int4["bytes_read"] * 3 < bf16["bytes_read"]  # (16 + 4) bytes a row against 64
    assert "Paged decode attention alone" in proc.stdout


def test_one_gpu_tensor_parallel_entry_is_tp1_only_and_says_so():
    from slimserve.eval.gpu_check import _tp_table, tp1_rows, tp_note

    decode = [
        {"weights": w, "kv": kv, "graphs": g, "batch": 16, "tok_s": t, "step_ms": 1.0}
        for w, kv, g, t in (
            ("bf16", "bf16", "off", 100.0),
            ("bf16", "bf16", "on", 150.0),
            ("W4A16", "bf16", "off", 200.0),
            ("bf16", "fp8", "off", 120.0),
        )
    ]
    decode.append({"weights": "bf16", "kv": "bf16", "graphs": "off", "error": "boom"})
    rows = tp1_rows(decode)
    assert [(r["tp"], r["tok_s"]) for r in rows] == [(1, 100.0)]  # bf16 weights and KV, eager
    note = tp_note(1, dry_run=False)
    assert note.startswith("one GPU: TP=1 only")
    table = _tp_table({"note": note, "rows": rows})
    assert "one GPU: TP=1 only" in table and "| 1 | 16 | 100.0 | 1.00 |  |  |" in table
    assert tp_note(2, dry_run=False).startswith("2 GPUs: TP=1")


def test_step_bytes_count_the_w4a16_kernel_repack():
    """After the load-time repack for the W4A16 kernel a QuantLinear's compressed-tensors
    buffers are empty and its weights live in `_prepared`: the roofline's bytes must count them
    (the first H200 run counted 1.07 GB for an 8B W4A16 model: the embedding alone)."""
    from dataclasses import replace

    import torch

    from slimserve.eval.engine_bench import SHAPES, quantize_randomly
    from slimserve.runtime.layers.quant_linear import QuantLinear
    from slimserve.runtime.models.load import random_model
    from slimserve.runtime.stats.rank_stats import model_bytes

    spec = replace(
        SHAPES["demo"],
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        inv_freq=SHAPES["demo"].inv_freq[:32],
    )
    model = random_model(spec, torch.bfloat16, torch.device("cpu"))
    quantize_randomly(model)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    int4 = sum(m.out_features * m.in_features // 2 for m in linears)
    before = model_bytes(model)
    for m in linears:
        m.prepare_kernel(release=True)
    assert all(m.weight_packed.numel() == 0 for m in linears)
    after = model_bytes(model)
    assert (
        after >= before - int4 // 8
        and after - sum(t.nbytes for t in [*model.parameters(), *model.buffers()]) >= int4
    )
