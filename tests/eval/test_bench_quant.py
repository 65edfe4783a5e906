"""The quantization benchmark's pure parts (generated recipes, drift ratios, its table) and its child runner."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slimserve.compress.recipe import parse_recipe
from slimserve.compress.registry import STAGES
from slimserve.eval.bench_common import json_tail, last_line, run_child
from slimserve.eval.bench_quant import (
    CONFIGS,
    PEER_METHOD,
    BenchConfig,
    Row,
    Workload,
    add_ratios,
    format_table,
    missing_stages,
    recipe_dict,
    recipe_yaml,
    workload,
)

GPTQ_W4 = next(c for c in CONFIGS if c.scheme == "W4A16 g128" and c.method == "gptq")
RTN_W4 = next(c for c in CONFIGS if c.scheme == "W4A16 g128" and c.method == "rtn")


def test_workloads_match_the_brief():
    full, quick = workload(False), workload(True)
    assert (full.dataset, full.num_samples, full.calib_seq_len, full.seed) == ("stdlib", 64, 512, 0)
    assert (full.eval_seq_len, full.max_windows) == (512, None)
    assert (quick.num_samples, quick.max_windows, quick.eval_seq_len) == (16, 40, 512)


def test_every_scheme_has_an_rtn_reference_and_every_row_is_unique():
    keys = [(c.scheme, c.method) for c in CONFIGS]
    assert len(keys) == len(set(keys))
    rtn_schemes = {c.scheme for c in CONFIGS if c.method == "rtn"}
    assert {c.scheme for c in CONFIGS} == rtn_schemes
    assert {c.peer_bits for c in CONFIGS if c.method == PEER_METHOD} == {4, 3}
    assert all(not c.stages for c in CONFIGS if c.peer_bits is not None)


def test_recipe_dict_full_and_quick(tmp_path):
    full = recipe_dict("/m", GPTQ_W4, workload(False), tmp_path / "out")
    assert full["calibration"] == {"dataset": "stdlib", "num_samples": 64, "seq_len": 512, "seed": 0}
    assert full["eval"] == {"dataset": "stdlib", "seq_len": 512}  # no max_windows: the whole split
    assert full["stages"] == [{"gptq": {"scheme": "W4A16", "group_size": 128}}]
    quick = recipe_dict("/m", GPTQ_W4, workload(True), tmp_path / "out")
    assert quick["eval"]["max_windows"] == 40 and quick["calibration"]["num_samples"] == 16


def test_recipe_dict_copies_stage_options():
    d = recipe_dict("/m", RTN_W4, Workload(), "/o")
    d["stages"][0]["rtn"]["scheme"] = "changed"
    assert RTN_W4.stages[0]["rtn"]["scheme"] == "W4A16"


def test_generated_recipes_validate(tmp_path):
    """Every configuration whose stages are registered passes the project's own recipe validation
    (so a stage's renamed option shows up here, not as a failed row hours into a benchmark)."""
    (tmp_path / "m").mkdir()
    runnable = [c for c in CONFIGS if c.stages and not missing_stages(c, STAGES)]
    assert any(c.method == "rtn" for c in runnable)
    for cfg in runnable:
        rec = parse_recipe(recipe_yaml(tmp_path / "m", cfg, workload(True), tmp_path / "o"), tmp_path / "r.yaml")
        assert rec.model == str(tmp_path / "m") and rec.eval.max_windows == 40
        assert [s.name for s in rec.stages] == [name for s in cfg.stages for name in s]


def test_missing_stages_in_recipe_order():
    cfg = BenchConfig("W4A16 g128", "awq + gptq", ({"awq": {}}, {"gptq": {}}))
    assert missing_stages(cfg, {"rtn": None}) == ["awq", "gptq"]
    assert missing_stages(cfg, {"awq": None, "gptq": None}) == []
    assert missing_stages(BenchConfig("x", PEER_METHOD, peer_bits=4), {}) == []


def test_ratios_use_the_same_schemes_rtn_drift():
    rows = [
        Row("W4", "rtn", drift=0.04), Row("W4", "gptq", drift=0.02), Row("W4", PEER_METHOD, drift=0.03),
        Row("W3", "rtn", drift=0.20), Row("W3", "gptq", drift=0.15),
        Row("W8A8", "rtn", status="failed"), Row("W8A8", "smoothquant + rtn", drift=0.01),
        Row("W2", "rtn", drift=0.0), Row("W2", "gptq", drift=0.1),
        Row("W4", "awq + rtn", status="skipped"),
        Row("W6", "rtn", drift=-0.01), Row("W6", "gptq", drift=0.01),
    ]
    add_ratios(rows)
    assert [r.ratio for r in rows[:5]] == pytest.approx([1.0, 0.5, 0.75, 1.0, 0.75])
    assert rows[6].ratio is None  # the rtn reference failed
    assert rows[8].ratio is None  # a zero reference drift has no ratio
    assert rows[9].ratio is None  # skipped
    assert rows[11].ratio is None  # nor does a negative one


META = {
    "hardware": {"cpu": "Test CPU 9000", "cores": 2, "gpu": "none", "torch": "2.13.0+cpu", "python": "3.11.7"},
    "model": {"name": "demo-model", "path": "/r/demo-model", "params": 12_345_678, "dtype": "bfloat16"},
    "workload": {"dataset": "stdlib", "num_samples": 64, "calib_seq_len": 512, "seed": 0, "eval_seq_len": 512,
                 "max_windows": None, "windows": 123, "tokens": 62_853},
    "peer": "llmcompressor 0.14.0.1 (own venv)",
}


def test_table_states_hardware_model_workload_and_rows():
    rows = [
        Row("baseline", "checkpoint", ppl=10.0),
        Row("W4A16 g128", "rtn", ppl=10.4, drift=0.04, ratio=1.0, quant_s=1.3, wall_s=30.0, rss_mb=812.4),
        Row("W4A16 g128", "gptq", ppl=10.2, drift=0.02, ratio=0.5, quant_s=12.0, wall_s=45.0, rss_mb=900.0),
        Row("W4A16 g128", "awq + rtn", status="skipped", note="stage awq not in STAGES yet"),
        Row("W4A16 g128", PEER_METHOD, status="failed", note="llm-compressor exit 1: ImportError: x"),
    ]
    text = format_table(META, rows)
    lines = text.splitlines()
    assert lines[0] == "hardware: Test CPU 9000, 2 cores, GPU none; torch 2.13.0+cpu, python 3.11.7"
    assert lines[1] == "model: demo-model (12.35M params, bfloat16) at /r/demo-model"
    assert "123 windows = 62,853 scored tokens" in lines[2] and "64 x 512 tokens, seed 0" in lines[2]
    assert lines[3] == "peer: llmcompressor 0.14.0.1 (own venv)"
    header = next(i for i, s in enumerate(lines) if s.startswith("scheme"))
    assert lines[header].split() == ["scheme", "method", "ppl", "drift", "%", "x", "RTN", "quant", "s", "wall",
                                     "s", "peak", "RSS", "MB", "note"]
    body = lines[header + 2: header + 2 + len(rows)]
    assert body[0].split() == ["baseline", "checkpoint", "10.0000", "—", "—", "—", "—", "—"]
    assert body[1].split() == ["W4A16", "g128", "rtn", "10.4000", "+4.00", "1.00", "1.3", "30.0", "812"]
    assert body[2].split()[3:] == ["10.2000", "+2.00", "0.50", "12.0", "45.0", "900"]
    assert body[3].endswith("skipped: stage awq not in STAGES yet")
    assert body[4].endswith("failed: llm-compressor exit 1: ImportError: x")
    # numeric columns are right-aligned: every row's ppl ends in the same column
    col = body[1].index("10.4000") + len("10.4000")
    assert body[0][col - len("10.0000"):col] == "10.0000" and body[2][col - len("10.2000"):col] == "10.2000"


def test_last_line_and_json_tail():
    assert last_line("a\r progress 50%\r progress 100%\n\nTypeError: bad\n  \n") == "TypeError: bad"
    assert last_line("") == ""
    assert json_tail('log line\n{"ppl": 3.5, "tokens": 10}\n') == {"ppl": 3.5, "tokens": 10}
    assert json_tail("no json here") is None and json_tail("[1, 2]") is None


def test_run_child_measures_that_child_alone(tmp_path):
    """wait4's rusage is the child's own: its 80 MB buffer shows, the small parent's memory does not.

    Linux copies the parent's RSS high-water mark into a forked child, so the measuring parent
    must be small, as the benchmark's driver is (it imports neither torch nor slimserve's
    compress code); pytest's process is not, hence the measurement runs from a fresh interpreter.
    """
    child = "b = bytearray(80_000_000); b[::4096] = b'x' * len(b[::4096])"
    driver = ("import json, sys; from pathlib import Path; from slimserve.eval.bench_common import run_child; "
              f"r = run_child([sys.executable, '-c', {child!r}], Path({str(tmp_path / 'big')!r})); "
              "print(json.dumps([r.returncode, r.seconds, r.max_rss_bytes]))")
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, check=True)
    rc, seconds, rss = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0 and seconds > 0
    assert 80e6 <= rss < 400e6
    bad = run_child([sys.executable, "-c", "import sys; print('{\"a\": 1}'); sys.exit('boom: no model')"],
                    tmp_path / "bad")
    assert bad.returncode == 1 and bad.stderr_tail == "boom: no model"
    assert json_tail(bad.stdout) == {"a": 1}
