"""Our engine serves Gemma 2, Gemma 3 text and Phi-3 (runtime/models/gemma.py,
runtime/models/phi3.py) as transformers computes them.

The models are tiny and random, built from a transformers config here (no downloads), with
weights drawn wide (std 0.15) so that greedy margins are far above fp32 rounding and so that the
soft caps bind (attention scores and logits well past the caps: `test_the_caps_and_the_window_
matter` shows transformers itself changes without them). The sliding window (8) is shorter
than most prompts. The reference is transformers' full forward over prompt + continuation
(teacher forcing, as tests/integration/test_moe_engine.py) and its `generate`; the engine
prefills in 16-token chunks beside other sequences' decodes and serves a second wave from the
prefix cache.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.llm import LLM
from slimserve.runtime.models.arch import model_spec
from slimserve.runtime.models.gemma import GemmaCausalLM
from slimserve.runtime.models.load import build_model
from slimserve.runtime.models.phi3 import Phi3CausalLM
from tests.helpers.tiny_model import save_wide_random
from tests.helpers.transformers_match import check_outputs, random_prompts, teacher_forced

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}
ORIGINAL = 32  # the LongRoPE model's original_max_position_embeddings
ARCHS = {
    "gemma2": dict(
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3_text": dict(
        sliding_window=8,
        query_pre_attn_scalar=24,
        final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
    # LongRoPE with the attention factor on cos/sin, full attention
    "phi3": dict(rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL),
    # Phi-4-mini's partial rotary dims, and a sliding window on every layer
    "phi3-partial-window": dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        sliding_window=8,
    ),
}
NEW = 12


def _save(mt_key: str, path):
    return save_wide_random(path, mt_key.split("-")[0], **BASE, **ARCHS[mt_key], pad_token_id=None)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    """(key, transformers fp32 model, its saved folder)."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, _save(request.param, path), path


def _engine_args(key: str) -> dict:
    # Phi-3's LongRoPE set follows max_model_len (runtime/models/phi3.py): the short factors for
    # a model served within the original length, which every sequence of these prompts is not
    if key == "phi3":
        return {"max_model_len": 128}
    return {}


def _prompts_for(key: str) -> list[list[int]]:
    # served past the original length: prompts longer than it, which transformers rotates with
    # the long factors from the start
    return random_prompts((40, 33, 57, 36)) if key == "phi3" else random_prompts()


def test_layers_load_under_checkpoint_names(arch):
    key, _, path = arch
    built = build_model(path, torch.float32, torch.device("cpu"), verify="none")
    model, spec = built.model, built.spec
    if key.startswith("gemma"):
        assert isinstance(model, GemmaCausalLM)
        assert spec.layer_windows == (8, None, 8, None)
        assert spec.attn_scale == 24**-0.5 and spec.sliding_window is None
        layer = model.model.layers[0]
        assert hasattr(layer, "pre_feedforward_layernorm")
        # q/k/v and gate/up fused at load (runtime/models/fuse.py)
        assert hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
        assert hasattr(layer.self_attn, "q_norm") == (key == "gemma3_text")
        assert bool(spec.local_inv_freq) == (key == "gemma3_text")
    else:
        assert isinstance(model, Phi3CausalLM)
        attn = model.model.layers[0].self_attn
        assert type(attn.qkv_proj) is torch.nn.Linear  # the checkpoint's own fused Linear
        assert spec.rotary_dim == (8 if key == "phi3-partial-window" else 16)
        assert spec.layer_windows == ((8,) * 4 if key == "phi3-partial-window" else ())
        if key == "phi3":
            assert spec.rope_original_max == ORIGINAL and spec.rope_attention_factor > 1.0


def test_fp32_engine_equals_transformers_with_chunked_prefill_and_prefix_hits(arch):
    key, model, path = arch
    prompts = _prompts_for(key)
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=16,
        block_size=8,
        **_engine_args(key),
    )
    params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    worst = check_outputs(
        llm.generate(prompts, params, use_tqdm=False), prompts, model, atol=1e-4, with_generate=True
    )
    before = llm.engine.block_manager.prefix_cache_hit_rate
    again = llm.generate(prompts[1:3], params, use_tqdm=False)
    worst = max(worst, check_outputs(again, prompts[1:3], model, atol=1e-4, with_generate=True))
    assert llm.engine.block_manager.prefix_cache_hit_rate > before
    print(f"{key} fp32 max top-5 logprob diff {worst:.2e}")


def test_phi3_within_the_original_length_uses_the_short_factors(tmp_path):
    model = _save("phi3", tmp_path)
    prompts = random_prompts((5, 17, 11))  # with NEW tokens, every sequence stays within 32
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=ORIGINAL, block_size=8)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    check_outputs(
        llm.generate(prompts, params, use_tqdm=False), prompts, model, atol=1e-4, with_generate=True
    )
    # served past the original length, the same prompts rotate with the long factors: not
    # transformers' logits for sequences this short (the choice is the model's, runtime/models/phi3.py)
    long = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64, block_size=8)
    outs = long.generate(prompts, params, use_tqdm=False)
    lp = teacher_forced(model, prompts[1], outs[1].outputs[0].token_ids)
    ours = torch.tensor(list(outs[1].outputs[0].logprobs[0][1].values()))
    theirs = lp[0, list(outs[1].outputs[0].logprobs[0][1])]
    assert (ours - theirs).abs().max() > 1e-3


def test_bf16_is_as_close_to_fp32_as_transformers_bf16(arch):
    key, model, path = arch
    prompts = _prompts_for(key)
    llm = LLM(str(path), dtype="bfloat16", device="cpu", **_engine_args(key))
    params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    model16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours_err, theirs_err, worst = [], [], 0.0
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
        worst = max(worst, float((ours - ref).abs().max()))
    ours_mean = float(torch.stack(ours_err).mean())
    theirs_mean = float(torch.stack(theirs_err).mean())
    print(f"{key} bf16 top-5 logprob diff from fp32: max {worst:.3f}, mean {ours_mean:.4f} "
          f"(transformers bf16 mean {theirs_mean:.4f})")  # fmt: skip
    assert ours_mean <= 1.5 * theirs_mean + 0.01, (key, ours_mean, theirs_mean)


@pytest.mark.parametrize(
    "key,off",
    [
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"final_logit_softcapping": None}),
        ("gemma2", {"sliding_window": 4096}),
        ("gemma3_text", {"sliding_window": 4096}),
        ("phi3-partial-window", {"sliding_window": None}),
    ],
)
def test_the_caps_and_the_window_matter(tmp_path, key, off):
    """Each cap and window changes transformers' own logits on these prompts, so the equality
    above checks them."""
    model = _save(key, tmp_path)
    other = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **off).eval()
    prompt = random_prompts()[2]  # 40 tokens: five windows
    with torch.no_grad():
        a = model(torch.tensor([prompt])).logits
        b = other(torch.tensor([prompt])).logits
    assert (a - b).abs().max() > 0.05


def test_other_model_types_are_still_refused_by_name():
    cfg = AutoConfig.for_model("gemma", **BASE)
    with pytest.raises(ArtifactError, match="model_type 'gemma' is not supported.*gemma2, "):
        model_spec(cfg)
