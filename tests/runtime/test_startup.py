"""Start-up of the ModelRunner: timed parts for the start-up log, and the profiling forward at
the largest step that sizes the KV cache on a GPU (runtime/worker/model_runner.py)."""

import pytest
import torch

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.layers.cpu_linear import PackedLinear
from slimserve.runtime.worker.model_runner import ModelRunner, startup_line
from tests.helpers import DEMO_MODEL


def test_startup_parts_are_timed_in_order_and_logged(caplog):
    caplog.set_level("INFO", logger="slimserve.runtime.worker.model_runner")
    runner = ModelRunner(EngineConfig(model=str(DEMO_MODEL), device="cpu"))
    packed = any(isinstance(m, PackedLinear) for m in runner.model.modules())
    # oneDNN's primitives built (runtime/layers/cpu_linear.py)
    warm = ["linear_warmup"] if packed else []
    assert list(runner.startup) == [
        "load",
        "weights",
        *warm,
        "profile",
        "kv_cache",
    ]  # no graphs on CPU
    assert all(s >= 0 for s in runner.startup.values()) and runner.startup["load"] > 0
    assert runner.activation_bytes == 0  # measured on CUDA only
    assert any("start-up: load" in r.getMessage() for r in caplog.records)


def test_startup_line():
    line = startup_line({"load": 2.345, "weights": 0.1, "kv_cache": 0.05}, 3 * 2**20)
    assert line == (
        "load 2.35 s, weights 0.10 s, kv cache 0.05 s, total 2.5 s; "
        "peak activations 3 MiB kept free of the KV cache"
    )


@pytest.mark.parametrize("tokens,seqs", [(96, 8), (20, 64), (3000, 1)])
def test_profile_batch_is_the_largest_step(tokens, seqs):
    runner = ModelRunner(
        EngineConfig(
            model=str(DEMO_MODEL), device="cpu", max_num_seqs=seqs, max_num_batched_tokens=tokens
        )
    )
    batch, caches = runner.profile_batch()
    rows = batch.logits_indices.shape[0]
    assert batch.input_ids.shape[0] == tokens
    # one row per sequence; a sequence never passes the model's 1024 positions
    assert rows == max(min(seqs, tokens), -(-tokens // runner.spec.max_position_embeddings))
    assert int(batch.positions.max()) < runner.spec.max_position_embeddings
    assert len(caches) == runner.spec.num_layers
    assert caches[0][0].shape[0] * runner.block_size >= tokens  # the scratch cache holds it all
    with torch.inference_mode():
        logits = runner.model(batch, caches)
    assert logits.shape == (rows, runner.spec.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.gpu
def test_kv_cache_leaves_room_for_the_profiled_activations():
    runner = ModelRunner(EngineConfig(model=str(DEMO_MODEL), device="cuda"))
    assert runner.activation_bytes > 0 and "profile" in runner.startup
    free_after = torch.cuda.mem_get_info()[0]
    assert free_after >= runner.activation_bytes  # what the profile measured is still there
