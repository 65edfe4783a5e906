"""The CPU engine keeps its KV cache in fp32 whatever the compute dtype (runtime/model_runner.py
`_kv_dtype`): bf16/fp16 K/V are stored exactly, so the tokens are those of a cache in the compute
dtype, without upcasting every gathered context on every step."""

import torch

from slimserve.runtime.llm import LLM
from slimserve.runtime.model_runner import ModelRunner
from slimserve.runtime.sequence import SamplingParams


def test_bf16_engine_caches_fp32_and_keeps_its_tokens(tiny_checkpoint, monkeypatch):
    prompts = [[5, 17, 42, 99, 3, 250], [7] * 40, [300, 2, 11]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16 and runner.kv_dtype == torch.float32
    assert all(k.dtype == v.dtype == torch.float32 for k, v in runner.kv_caches)
    wide = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    monkeypatch.setattr(ModelRunner, "_kv_dtype", lambda self: self.dtype)  # a bf16 cache
    narrow = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    assert narrow.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert [o.outputs[0].token_ids for o in narrow.generate(prompts, params, use_tqdm=False)] == wide


def test_fp8_cache_is_kept_on_cpu(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert llm.engine.runner.kv_dtype == torch.float8_e4m3fn
