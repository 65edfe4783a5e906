"""The serving engine with the Triton kernel path forced on (interpreter on CPU) against its
torch path: same tokens on the trained demo model, close logits with W4A16 weights + fp8 KV."""

import pytest
import torch

from slimserve.eval.engine_bench import quantize_randomly
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.worker.model_runner import ModelRunner
from tests.helpers import DEMO_MODEL

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n\n\ndef main():\n", "x = ["]


def _greedy(backend, monkeypatch, **kw):
    monkeypatch.setenv("SLIMSERVE_KERNELS", backend)
    engine = LLMEngine(
        EngineConfig(
            model=str(DEMO_MODEL),
            dtype="float16",
            block_size=16,
            max_num_batched_tokens=12,
            kv_cache_memory="8MiB",
            **kw,
        )
    )
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(PROMPTS))]


def test_kernel_path_generates_the_torch_paths_tokens(monkeypatch):
    # fp16 on both paths; the kernels accumulate in fp32 like torch does, so the trained model's
    # greedy choices (margins >> fp16 rounding) agree. Chunked prefill (12-token budget) mixes
    # prefill chunks with decodes, so both attention kernels and the cache writes run.
    assert _greedy("triton", monkeypatch) == _greedy("torch", monkeypatch)


def _logits(backend, monkeypatch, kv_cache_dtype, scheme="W4A16"):
    monkeypatch.setenv("SLIMSERVE_KERNELS", backend)
    config = EngineConfig(
        model=str(DEMO_MODEL),
        dtype="float16",
        kv_cache_memory="4MiB",
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(config)
    torch.manual_seed(0)
    quantize_randomly(runner.model, group_size=128, seed=1, scheme_name=scheme)
    for layer in runner.model.model.layers:  # non-trivial fp8 scales
        layer.self_attn.k_scale.fill_(0.05)
        layer.self_attn.v_scale.fill_(0.02)
    runner._prepare_weights()
    table = [[3, 1], [0, 2]]
    prefill = runner.prepare(
        [[5, 9, 100, 7, 42, 3, 8, 11, 12], [17, 4]], [0, 0], table, [True, True]
    )
    first = runner.execute(prefill)
    decode = runner.prepare([[77], [78]], [9, 2], table, [True, True])
    return first, runner.execute(decode)


@pytest.mark.parametrize(
    "kv_cache_dtype,scheme", [("auto", "W4A16"), ("fp8_e4m3", "W4A16"), ("auto", "W8A8")]
)
def test_kernel_path_logits_match_torch_path_with_quantized_weights(
    monkeypatch, kv_cache_dtype, scheme
):
    got = _logits("triton", monkeypatch, kv_cache_dtype, scheme)
    want = _logits("torch", monkeypatch, kv_cache_dtype, scheme)
    for g, w in zip(got, want):
        # fp16 activations through 4 layers: each op rounds to fp16 (2^-11 relative) in a
        # different order on the two paths; logits of magnitude ~|w| drift by a few fp16 ulps
        # per layer, so 2% of the logit range bounds it with margin and still catches any
        # wrong index, scale or mask (which move logits by O(range)).
        span = float(w.max() - w.min())
        torch.testing.assert_close(g, w, rtol=0, atol=0.02 * span)


def test_w4a16_layers_are_repacked_at_load_and_hold_their_weights_once(monkeypatch):
    """The runner repacks W4A16 layers before the KV cache is sized (not on the first request)
    and releases the compressed-tensors buffers the repacked copy replaces."""
    from slimserve.runtime.layers.quant_linear import QuantLinear

    monkeypatch.setenv("SLIMSERVE_KERNELS", "triton")
    runner = ModelRunner(
        EngineConfig(model=str(DEMO_MODEL), dtype="float16", kv_cache_memory="4MiB")
    )
    quantize_randomly(runner.model, group_size=128, seed=1, scheme_name="W4A16")
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    before = sum(m.weight_packed.numel() for m in layers)
    runner._prepare_weights()
    assert before > 0 and all(
        m.weight_packed.numel() == 0 and m.weight_scale.numel() == 0 for m in layers
    )
    assert all(m._prepared.qweight.numel() * 8 >= m.in_features * m.out_features for m in layers)
    with pytest.raises(RuntimeError, match="released after the W4A16 repack"):
        layers[0].dequantized_weight(torch.float16)
