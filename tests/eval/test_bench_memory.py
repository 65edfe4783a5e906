"""The memory benchmark's pure parts: checkpoint config, parameter count, recipe, table and verdict."""

from __future__ import annotations

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
)
from slimserve.eval.demo_model import model_config as demo_config

WIDTH_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias")


def test_config_has_the_demo_width_and_only_the_depth_changes():
    demo = demo_config(4096, 0)
    for layers in (8, 32):
        cfg = model_config(layers, 4096, 0)
        assert cfg.num_hidden_layers == layers
        assert {k: getattr(cfg, k) for k in WIDTH_KEYS} == {k: getattr(demo, k) for k in WIDTH_KEYS}
    assert (demo.hidden_size, demo.intermediate_size, demo.num_attention_heads,
            demo.num_key_value_heads, demo.head_dim) == (384, 1024, 6, 2, 64)
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


def test_recipe_parses_and_matches_the_brief(tmp_path):
    (tmp_path / "m").mkdir()
    d = recipe_dict(tmp_path / "m", Workload(), tmp_path / "out")
    assert d["calibration"] == {"dataset": "stdlib", "num_samples": 64, "seq_len": 512, "seed": 0}
    assert d["stages"] == [{"gptq": {"scheme": "W4A16", "group_size": 128}}]
    assert d["eval"]["max_windows"] == 4 and d["eval"]["max_ppl_increase"] >= 1e3
    rec = parse_recipe(yaml.safe_dump(d), tmp_path / "r.yaml")
    assert [s.name for s in rec.stages] == ["gptq"] and rec.eval.max_windows == 4
    assert workload(True).num_samples < workload(False).num_samples


def _rows(shallow_rss: float, deep_rss: float) -> list[Row]:
    # 10M and 40M params: fp32 40 and 160 MB.
    return [Row(8, 10_000_000, peak_rss_mb=shallow_rss, wall_s=1.0),
            Row(32, 40_000_000, peak_rss_mb=deep_rss, wall_s=2.0)]


def test_working_memory_subtracts_the_fp32_model():
    r = Row(8, 10_000_000, peak_rss_mb=1000.0)
    assert (r.weight_mb, r.fp32_mb, r.working_mb) == (20.0, 40.0, 960.0)
    assert Row(8, 1).working_mb is None


def test_verdict_flat_within_tolerance():
    v = verdict(_rows(1040.0, 1160.0 + 0.2 * 1000))  # working 1000 -> 1200 MB: 1.2x
    assert (v.shallow, v.deep, v.grows) == (8, 32, False)
    assert v.ratio == pytest.approx(1.2)
    assert "does not grow" in v.text and "4.00x" in v.text
    assert v.bytes_per_param == pytest.approx(200e6 / 30e6)  # +200 MB for +30M params
    assert "+6.67 bytes" in v.text


def test_verdict_grows_beyond_tolerance_and_honours_a_custom_tolerance():
    rows = _rows(1040.0, 1160.0 + 0.3 * 1000)  # 1.3x
    assert verdict(rows).grows is True and "GROWS" in verdict(rows).text
    assert verdict(rows, tolerance=0.5).grows is False
    assert TOLERANCE == 0.25


def test_verdict_undecided_without_two_ok_depths():
    rows = _rows(1040.0, 1400.0)
    rows[1].status, rows[1].peak_rss_mb = "failed", None
    assert verdict(rows).grows is None and verdict(rows[:1]).grows is None
    assert verdict([]).text.startswith("undecided")


def test_table_states_hardware_model_workload_and_verdict():
    rows = _rows(1040.0, 1200.0)
    rows.append(Row(4, 5_000_000, status="failed", note="exit 2: boom"))
    meta = {
        "hardware": {"cpu": "TestCPU", "cores": 2, "gpu": "none", "torch": "2.x", "python": "3.11"},
        "model": {"hidden_size": 384, "intermediate_size": 1024, "heads": 6, "kv_heads": 2, "head_dim": 64,
                  "vocab_size": 4096, "tokenizer": "test tokenizer"},
        "workload": {**asdict(Workload()), "threads": 1},
    }
    v = verdict(rows)
    text = format_table(meta, rows, v)
    lines = text.splitlines()
    assert lines[0].startswith("hardware: TestCPU, 2 cores")
    assert lines[1].startswith("model: random-init LlamaForCausalLM") and "hidden 384" in lines[1]
    assert lines[2].startswith("workload:") and "64 x 512" in lines[2] and "g128" in lines[2]
    header = next(ln for ln in lines if ln.startswith("layers"))
    for col in ("params M", "weight MB bf16", "peak RSS MB", "RSS - fp32 MB", "wall s"):
        assert col in header
    row32 = next(ln for ln in lines if ln.lstrip().startswith("32 "))
    assert "40.00" in row32 and "1040" in row32  # params M; working = 1200 - 160
    assert "failed: exit 2: boom" in text and text.rstrip().endswith(v.text)


def test_parse_args_defaults_and_rejects_bad_values():
    a = parse_args([])
    assert (a.layers, a.quick, a.threads) == (None, False, 1)
    assert parse_args(["--layers", "8", "32"]).layers == [8, 32]
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--threads", "0"])
