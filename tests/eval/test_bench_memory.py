"""The memory benchmark's pure parts: checkpoint config, parameter count, recipe, table and verdict."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
import yaml

from slimserve.compress.recipe import parse_recipe
from slimserve.eval.bench_memory import (
    TOLERANCE,
    Row,
    Workload,
    format_table,
    model_config,
    param_count,
    parse_args,
    recipe_dict,
    verdict,
    workload,
    write_checkpoint,
)
from slimserve.eval.demo_model import model_config as demo_config

WIDTH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
)


def test_config_has_the_demo_width_and_only_the_depth_changes():
    demo = demo_config(4096, 0)
    for layers in (8, 32):
        cfg = model_config(layers, 4096, 0)
        assert cfg.num_hidden_layers == layers
        assert {k: getattr(cfg, k) for k in WIDTH_KEYS} == {k: getattr(demo, k) for k in WIDTH_KEYS}
    assert (
        demo.hidden_size,
        demo.intermediate_size,
        demo.num_attention_heads,
        demo.num_key_value_heads,
        demo.head_dim,
    ) == (384, 1024, 6, 2, 64)
    assert demo_config(4096, 0).num_hidden_layers == 4  # the demo's own config is not mutated


@pytest.mark.parametrize("layers,vocab,tied", [(1, 4096, False), (3, 517, False), (2, 300, True)])
def test_param_count_matches_an_instantiated_model(layers, vocab, tied):
    from transformers import LlamaForCausalLM

    cfg = model_config(layers, vocab, 0)
    cfg.tie_word_embeddings = tied
    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_param_count_closed_form():
    # Per layer: q,o 384x384; k,v 384x128; gate,up,down 384x1024; 2 norms of 384.
    per_layer = 2 * 384 * 384 + 2 * 384 * 128 + 3 * 384 * 1024 + 2 * 384
    assert param_count(model_config(8, 4096, 0)) == 2 * 4096 * 384 + 8 * per_layer + 384


def test_8b_shape_is_llama3_8b():
    cfg = model_config(32, 4096, 7, "8b")
    assert (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.tie_word_embeddings,
    ) == (4096, 14336, 32, 8, 128, 128256, False)
    assert param_count(cfg) == 8_030_261_248  # Llama-3-8B's parameter count
    assert param_count(model_config(8, 4096, 7, "8b")) * 2 / 1e9 == pytest.approx(
        5.59, abs=0.01
    )  # 8 layers: 5.59 GB


def test_recipe_parses_and_matches_the_brief(tmp_path):
    (tmp_path / "m").mkdir()
    d = recipe_dict(tmp_path / "m", Workload(), tmp_path / "out")
    assert d["calibration"] == {
        "dataset": "stdlib",
        "num_samples": 64,
        "seq_len": 512,
        "seed": 0,
        "dtype": "auto",
    }
    assert d["stages"] == [{"gptq": {"scheme": "W4A16", "group_size": 128}}]
    assert d["eval"]["max_windows"] == 4 and d["eval"]["max_ppl_increase"] >= 1e3
    rec = parse_recipe(yaml.safe_dump(d), tmp_path / "r.yaml")
    assert (
        [s.name for s in rec.stages] == ["gptq"]
        and rec.eval.max_windows == 4
        and rec.device == "cpu"
    )
    assert workload(True).num_samples < workload(False).num_samples
    big = workload(False, "8b")
    assert (big.num_samples, big.calib_seq_len, big.eval_batch, big.calibration_dtype) == (
        16,
        256,
        1,
        "float32",
    )
    assert workload(False, "8b", "cuda").calibration_dtype == "auto"
    rec = parse_recipe(
        yaml.safe_dump(recipe_dict(tmp_path / "m", big, tmp_path / "out")), tmp_path / "r.yaml"
    )
    assert rec.calibration.dtype == "float32" and rec.eval.batch_size == 1


def test_written_checkpoint_loads_and_matches_the_config(tmp_path):
    from transformers import AutoTokenizer

    from slimserve.runtime.corpus import read_texts
    from slimserve.runtime.loading.loader import load_model
    from tests.helpers.tiny_model import tiny_tokenizer

    tok = tiny_tokenizer(read_texts("validation")[:2], 300)
    cfg = model_config(3, len(tok), tok.eos_token_id)
    params = write_checkpoint(tmp_path / "ck", cfg, tok, seed=1)
    assert params == param_count(cfg)
    files = sorted(p.name for p in (tmp_path / "ck").glob("*.safetensors"))
    assert files == [
        f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)
    ]  # a file per layer + trunk
    model = load_model(tmp_path / "ck").model
    assert model.dtype == torch.bfloat16 and sum(p.numel() for p in model.parameters()) == params
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    w = model.model.layers[2].mlp.down_proj.weight.float()
    assert 0.015 < w.std().item() < 0.025
    assert isinstance(AutoTokenizer.from_pretrained(tmp_path / "ck"), type(tok))


def _rows(shallow_rss: float, deep_rss: float) -> list[Row]:
    # 100M and 400M params: bf16 checkpoints of 200 and 800 MB.
    return [
        Row(8, 100_000_000, peak_rss_mb=shallow_rss, wall_s=1.0, gptq_s=4.0),
        Row(32, 400_000_000, peak_rss_mb=deep_rss, wall_s=2.0, gptq_s=16.0),
    ]


def test_row_ratios():
    r = Row(8, 100_000_000, peak_rss_mb=100.0, gptq_s=4.0)
    assert (r.weight_mb, r.rss_ratio, r.layer_s) == (200.0, 0.5, 0.5)
    assert Row(8, 1).rss_ratio is None and Row(8, 1).layer_s is None


def test_verdict_flat_within_tolerance():
    v = verdict(_rows(150.0, 160.0))  # 1.067x
    assert (v.shallow, v.deep, v.grows, v.above_checkpoint) == (8, 32, False, [])
    assert v.ratio == pytest.approx(160 / 150)
    assert (
        "is flat" in v.text
        and "4.00x" in v.text
        and "32-layer peak is below its bf16 checkpoint (160 vs 800 MB)" in v.text
    )


def test_verdict_grows_beyond_tolerance_and_honours_a_custom_tolerance():
    rows = _rows(150.0, 180.0)  # 1.2x
    assert verdict(rows).grows is True and "GROWS" in verdict(rows).text
    assert verdict(rows, tolerance=0.25).grows is False
    assert TOLERANCE == 0.10


def test_verdict_holds_only_the_deepest_run_to_its_checkpoint():
    # 8 layers: 250 MB peak over a 200 MB checkpoint, the fixed cost of a shallow model: not judged.
    v = verdict(_rows(250.0, 260.0))
    assert v.grows is False and v.above_checkpoint == [] and "32-layer peak is below" in v.text
    v = verdict(_rows(800.0, 820.0))  # 32 layers: 820 MB over an 800 MB checkpoint
    assert (
        v.grows is False and v.above_checkpoint == [32] and "32-layer peak is NOT below" in v.text
    )


def test_verdict_undecided_without_two_ok_depths():
    rows = _rows(150.0, 160.0)
    rows[1].status, rows[1].peak_rss_mb = "failed", None
    assert verdict(rows).grows is None and verdict(rows[:1]).grows is None
    assert verdict([]).text.startswith("undecided")


def test_table_states_hardware_model_workload_and_verdict():
    rows = _rows(150.0, 160.0)
    rows.append(Row(4, 5_000_000, status="failed", note="exit 2: boom"))
    meta = {
        "hardware": {"cpu": "TestCPU", "cores": 2, "gpu": "none", "torch": "2.x", "python": "3.11"},
        "model": {
            "shape": "8b",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "heads": 32,
            "kv_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "tokenizer": "test tokenizer",
        },
        "workload": {**asdict(workload(False, "8b")), "threads": 1},
    }
    v = verdict(rows)
    text = format_table(meta, rows, v)
    lines = text.splitlines()
    assert lines[0].startswith("hardware: TestCPU, 2 cores")
    assert (
        lines[1].startswith("model: random-init LlamaForCausalLM, Llama-3-8B shape")
        and "hidden 4096" in lines[1]
    )
    assert "GPTQ replays in fp32" in lines[1]
    assert (
        lines[2].startswith("workload: compress run on cpu")
        and "16 x 256" in lines[2]
        and "g128" in lines[2]
    )
    header = next(ln for ln in lines if ln.startswith("layers"))
    for col in ("params M", "bf16 ckpt MB", "peak RSS MB", "RSS / ckpt", "s / layer", "wall s"):
        assert col in header
    row32 = next(ln for ln in lines if ln.lstrip().startswith("32 "))
    assert "400.00" in row32 and "800" in row32 and "0.20" in row32 and "0.5" in row32
    assert "failed: exit 2: boom" in text and text.rstrip().endswith(v.text)


def test_parse_args_defaults_and_rejects_bad_values():
    a = parse_args([])
    assert (a.layers, a.quick, a.threads, a.shape, a.device) == (None, False, 1, "demo", "cpu")
    a = parse_args(["--layers", "8", "32", "--shape", "8b"])
    assert a.layers == [8, 32] and a.threads == (os.cpu_count() or 1)
    assert parse_args(["--shape", "8b", "--threads", "1"]).threads == 1
    for bad in (["--layers", "0"], ["--threads", "0"], ["--shape", "70b"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
