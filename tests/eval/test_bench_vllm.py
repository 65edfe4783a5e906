"""eval/bench_vllm.py without vLLM: our child's output on a tiny model, the agreement count,
the table, and the one-line refusals of its arguments. The peer side runs in the benchmark."""

import json

import pytest

from slimserve.eval import bench_vllm as bv


def test_our_child_generates_exactly_the_asked_tokens(tiny_checkpoint, tmp_path):
    w = {
        "model": str(tiny_checkpoint),
        "prompts": [[5, 6, 7, 8], [9, 10, 11]],
        "max_tokens": 5,
        "dtype": "float32",
        "kv_cache_dtype": "auto",
        "max_num_seqs": 8,
        "max_model_len": 64,
        "warmup": 1,
    }
    (tmp_path / "w.json").write_text(json.dumps(w))
    bv.ours_child(str(tmp_path / "w.json"), str(tmp_path / "o.json"), threads="1")
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["output_tokens"] == 10 and [len(t) for t in out["tokens"]] == [5, 5]
    assert out["threads"]["setting"] == 1 and out["threads"]["final"] == 1


def test_agreement_counts_identical_sequences_and_where_others_part():
    a = bv.agreement([[1, 2, 3], [1, 2, 3], [4, 5, 6]], [[1, 2, 3], [1, 9, 3], [4, 5, 7]])
    assert (a["identical"], a["of"], a["median_first_difference"]) == (1, 3, 1.5)
    assert bv.agreement([[1]], [[1]])["median_first_difference"] is None


def test_the_table_gives_medians_spreads_ratio_and_missing_rows():
    rows = [
        {
            "name": "demo bf16",
            "condition": "busy",
            "prompts": 64,
            "ours": bv.spread([100.0, 300.0, 200.0]),
            "vllm": bv.spread([100.0, 120.0, 80.0]),
            "ratio": 2.0,
            "ours_threads": [{"final": 1}, {"final": 1}, {"final": 2}],
            "agreement": {"identical": 60, "of": 64},
        }
    ]
    result = {
        "hardware": {"cpu": "X", "isa": "avx512_bf16", "cores": 2, "torch": "2.13.0"},
        "workload": {
            "input_len": 128,
            "output_len": 128,
            "dtype": "float32",
            "runs": 3,
            "vllm_cores": "all",
            "ours_threads": "auto",
        },
        "rows": rows,
        "missing": ["SmolLM2 W8A8: artifacts/x is missing (make it with: compress run r.yaml)"],
    }
    text = bv.markdown(result)
    assert "greedy, EOS ignored, float32, 3 runs each" in text
    assert (
        "| demo bf16 | busy | 64 | 200 (100-300) | 100 (80-120) | 2.00x | 1,1,2 | 60/64 |" in text
    )
    assert (
        "- missing: SmolLM2 W8A8: artifacts/x is missing (make it with: compress run r.yaml)"
        in text
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rows", "demo,llama"], "--rows: llama unknown"),
        (["--conditions", "loaded"], "--conditions: loaded unknown; use idle, busy"),
        (["--runs", "0"], "--runs: must be >= 1, got 0"),
    ],
)
def test_bad_arguments_are_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        bv.main(argv)


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_is_what_our_runtime_picks_on_this_cpu(monkeypatch, native, expected):
    import slimserve.runtime.dtypes as dtypes

    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    assert bv.bench_dtype("auto") == expected
    assert bv.bench_dtype("bfloat16") == "bfloat16" and bv.bench_dtype("float32") == "float32"


def test_an_unknown_dtype_is_one_line():
    with pytest.raises(SystemExit, match="--dtype: 'fp4' unknown; use auto, float16"):
        bv.main(["--dtype", "fp4"])
