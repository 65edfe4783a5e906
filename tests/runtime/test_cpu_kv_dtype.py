"""The CPU engine's KV-cache dtype (runtime/worker/model_runner.py `_kv_dtype`): the compute dtype where
the compiled CPU attention reads it in place (kernels/cpu_attention.py), fp32 where the torch twin
attends (it reads fp32, and bf16/fp16 K/V are stored exactly); the tokens are the same either way."""

import pytest
import torch

from slimserve.kernels import cpu_attention
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.worker.model_runner import ModelRunner

PROMPTS = [[5, 17, 42, 99, 3, 250], [7] * 40, [300, 2, 11]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_twin_caches_fp32_and_keeps_the_bf16_caches_tokens(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16 and runner.kv_dtype == torch.float32
    assert all(k.dtype == v.dtype == torch.float32 for k, v in runner.kv_caches)
    wide = _tokens(llm)

    monkeypatch.setattr(ModelRunner, "_kv_dtype", lambda self: self.dtype)  # a bf16 cache
    narrow = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    assert narrow.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert _tokens(narrow) == wide


@pytest.mark.skipif(not cpu_attention.available(), reason="no CPU kernel")
def test_compiled_kernel_caches_in_the_compute_dtype_with_the_twins_tokens(
    tiny_checkpoint, monkeypatch
):
    monkeypatch.setenv("SLIMSERVE_KERNELS", "auto")
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    assert llm.engine.runner.kv_dtype == torch.bfloat16
    got = _tokens(llm)
    monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")
    twin = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    assert twin.engine.runner.kv_dtype == torch.float32
    assert _tokens(twin) == got
    monkeypatch.setenv("SLIMSERVE_KERNELS", "auto")
    fp16 = LLM(str(tiny_checkpoint), device="cpu", dtype="float16", enable_prefix_caching=False)
    assert fp16.engine.runner.kv_dtype == torch.float32  # the kernel reads no fp16 caches


def test_fp8_cache_is_kept_on_cpu(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert llm.engine.runner.kv_dtype == torch.float8_e4m3fn


def test_start_up_says_which_cpu_path_serves(tiny_checkpoint, monkeypatch, caplog):
    caplog.set_level("INFO", logger="slimserve.runtime.worker.model_runner")
    monkeypatch.setenv("SLIMSERVE_KERNELS", "auto")
    if cpu_attention.available():
        LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16")
        assert any("CPU kernels: C" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    monkeypatch.setattr(cpu_attention, "unavailable_reason", lambda: "no C compiler (set CC)")
    LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("unavailable (no C compiler (set CC))" in m and "torch twins" in m for m in warned)
