"""Our engine serves mixture-of-experts models (runtime/models/moe.py) as transformers computes
them: Qwen3-MoE (with a dense layer among the sparse ones), Qwen2-MoE (shared expert), Mixtral
(its `block_sparse_moe` names), OLMoE (q/k norms over the whole projection, clip_qkv).

The models are tiny and random, built from a transformers config here (no downloads), with
weights drawn wide enough (std 0.15) that routing is decisive and greedy margins are far above
fp32 rounding. The reference is transformers' full forward over prompt + continuation
(teacher forcing), as in tests/integration/test_engine.py: no KV cache on its side. The engine
prefills in 16-token chunks beside other sequences' decodes and serves a second wave from the
prefix cache.
"""

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slimserve.runtime.distributed.sharding import check_tensor_parallel
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.models.load import build_model
from slimserve.runtime.models.moe import SparseMoeBlock
from tests.helpers.transformers_match import check_outputs, random_prompts, teacher_forced

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
EXPERTS = {
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, clip_qkv=0.5),
}  # fmt: skip
NEW = 12


@pytest.fixture(scope="module", params=sorted(EXPERTS))
def moe(request, tmp_path_factory):
    """(model_type, transformers fp32 model, its saved folder)."""
    mt = request.param
    cfg = AutoConfig.for_model(mt, **BASE, **EXPERTS[mt])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.15)
    path = tmp_path_factory.mktemp(mt)
    model.save_pretrained(path)
    return mt, model, path


def test_moe_layers_load_under_checkpoint_names(moe):
    mt, model, path = moe
    built = build_model(path, torch.float32, torch.device("cpu"), verify="none")
    layers = built.model.model.layers
    sparse = built.spec.moe.sparse_layers
    assert sparse == ((True, False, True) if mt == "qwen3_moe" else (True, True, True))
    for layer, is_moe in zip(layers, sparse):
        assert isinstance(layer.ffn, SparseMoeBlock) == is_moe
    block = layers[0].ffn
    assert len(block.experts) == EXPERTS[mt].get(
        "num_experts", EXPERTS[mt].get("num_local_experts")
    )
    assert layers[0].ffn_name == ("block_sparse_moe" if mt == "mixtral" else "mlp")
    assert hasattr(block, "shared_expert") == (mt == "qwen2_moe")
    # each expert's gate and up were fused into one GEMM at load (runtime/models/fuse.py)
    assert all(hasattr(e, "gate_up_proj") for e in block.experts)


def test_moe_engine_equals_transformers_with_chunked_prefill_and_prefix_hits(moe):
    mt, model, path = moe
    prompts = random_prompts()
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=16, block_size=8)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    check_outputs(llm.generate(prompts, params, use_tqdm=False), prompts, model, atol=1e-4)
    before = llm.engine.block_manager.prefix_cache_hit_rate
    again = llm.generate(prompts[1:3], params, use_tqdm=False)
    check_outputs(again, prompts[1:3], model, atol=1e-4)
    assert llm.engine.block_manager.prefix_cache_hit_rate > before


def test_moe_bf16_is_as_close_to_fp32_as_transformers_bf16(moe):
    mt, model, path = moe
    prompts = random_prompts()
    llm = LLM(str(path), dtype="bfloat16", device="cpu")
    params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    model16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours_err, theirs_err = [], []
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        truth = teacher_forced(model, prompt, got.token_ids)
        lp16 = teacher_forced(model16, prompt, got.token_ids)
        ids = [list(top) for _, top in got.logprobs]
        ours = torch.tensor([list(top.values()) for _, top in got.logprobs])
        ref = torch.stack([truth[j, ids[j]] for j in range(len(ids))])
        theirs = torch.stack([lp16[j, ids[j]] for j in range(len(ids))])
        ours_err.append((ours - ref).abs().mean())
        theirs_err.append((theirs - ref).abs().mean())
    ours_mean, theirs_mean = (
        float(torch.stack(ours_err).mean()),
        float(torch.stack(theirs_err).mean()),
    )
    assert ours_mean <= 1.5 * theirs_mean + 0.01, (mt, ours_mean, theirs_mean)


def test_moe_tensor_and_pipeline_parallel_generate_the_tokens_of_one_process(moe):
    """TP=2 splits every expert's FFN (and the shared expert's) in halves, one all-reduce per
    block; PP=2 puts Qwen3-MoE's dense layer 1 and sparse layer 2 on different stages, and
    OLMoE's layers 0-1 and 2 (its TP, q/k norms over every head: tests/integration/
    test_tp_archs.py)."""
    mt, _, path = moe
    prompts = random_prompts()
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    engine = {"device": "cpu", "dtype": "float32", "kv_cache_memory": 4 * 2**20}
    one = [o.outputs[0].token_ids for o in LLM(str(path), **engine).generate(prompts, params)]
    pp = mt in ("qwen3_moe", "olmoe")
    split = {"pipeline_parallel_size": 2} if pp else {"tensor_parallel_size": 2}
    llm = LLM(str(path), **engine, **split)
    try:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert two == one


def test_moe_sizes_that_split_experts_unevenly_are_refused_in_one_line(moe):
    _, _, path = moe
    spec = build_model(path, torch.float32, torch.device("cpu"), verify="none").spec
    check_tensor_parallel(spec, 2, None)  # 32 (Mixtral: 96) expert rows, 16 (48) per rank
    odd = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate_size=33))
    with pytest.raises(ValueError, match="2 does not divide the experts' intermediate size 33"):
        check_tensor_parallel(odd, 2, None)
