"""The host-overhead benchmark runs against today's engine: its stub runner keeps up with the
runner interface the engine reads (a missing attribute broke it once without any test failing)."""

from transformers import AutoTokenizer

from slimserve.eval import bench_host_overhead as bench


def test_measure_runs_and_splits_the_step():
    tok = AutoTokenizer.from_pretrained(bench.DEMO_MODEL)
    row = bench.measure(num_seqs=4, context=64, steps=2, tokenizer=tok)
    assert (row["seqs"], row["context"]) == (4, 64)
    parts = sum(row[f"{k}_ms"] for k in ("schedule", "prepare", "sample", "update", "other"))
    assert row["step_ms"] > 0 and parts >= row["step_ms"] - 1e-6  # "other" is the remainder
    assert row["sample_ms"] > 0 and row["prepare_ms"] > 0
