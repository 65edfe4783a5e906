"""Tensor and pipeline parallelism for the architectures beyond the Llama family's layout:
OLMoE (q/k norms over the whole projection: their sums of squares all-reduced,
runtime/distributed/layers.py `FullWidthQKNorm`), Gemma 2 and Gemma 3 text (per-layer sliding
windows, attention and final soft caps, (1 + w) norms, GeGLU, scaled embeddings) and Phi-3 (its
fused `qkv_proj` / `gate_up_proj` read part by part, runtime/distributed/sharding.py; partial
rotary dims, LongRoPE).

The models are tiny and random, built from a transformers config here (no downloads), weights
drawn wide (std 0.15) so that greedy margins are far above fp32 rounding, as in
tests/integration/test_moe_engine.py and test_gemma_phi3_engine.py. OLMoE and Phi-3 have one
KV head, so each of the two ranks holds a copy of it (OLMoE: only one of them adds its k part to
the norm's sum). Gemma's layer types are full, sliding, sliding, full: the second pipeline stage
(layers 2-3) attends sliding then full, which local indices would get backwards. Each split
engine starts one worker process (gloo on CPU); its greedy tokens and top-5 logprobs (fp32,
prompts prefilled in 16-token chunks beside other sequences' decodes) are compared with one
process's.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.llm import LLM
from tests.helpers.tiny_model import save_wide_random

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
ARCHS = {
    "olmoe": dict(num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, clip_qkv=2.0),
    "gemma2": dict(
        sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, layer_types=LAYER_TYPES,
    ),
    "gemma3_text": dict(
        sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=4.0,
        layer_types=LAYER_TYPES,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
    # Phi-4-mini's partial rotary dims under LongRoPE (served past the original length: the
    # long factors), a window on every layer
    "phi3": dict(
        num_key_value_heads=1, sliding_window=8, original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.1 * i for i in range(4)],
            "long_factor": [2.0 + 0.5 * i for i in range(4)],
        },
    ),
}  # fmt: skip
NEW = 10
ENGINE = dict(
    device="cpu", dtype="float32", kv_cache_memory=4 * 2**20, max_num_batched_tokens=16,
    block_size=8, max_model_len=128,
)  # fmt: skip
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=5, ignore_eos=True)


def _save(mt: str, path):
    save_wide_random(path, mt, **{**BASE, **ARCHS[mt]}, pad_token_id=None)
    return path


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (40, 23, 35)]


def _run(path, **split) -> tuple[list, dict | None]:
    """(outputs, rank 0's collective counters over the generate; None in one process)."""
    llm = LLM(str(path), **ENGINE, **split)
    try:
        runner = llm.engine.runner
        before = runner.comm_stats() if split else None
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        if not split:
            return outs, None
        after = runner.comm_stats()
        return outs, {k: after[k] - before[k] for k in ("steps", "comm_calls")}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    """(model_type, saved folder, one process's outputs)."""
    path = _save(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, _run(path)[0]


def _same(one, two) -> float:
    """Greedy tokens equal; returns the largest difference of the top-5 logprobs."""
    worst = 0.0
    for a, b in zip(one, two):
        a, b = a.outputs[0], b.outputs[0]
        assert b.token_ids == a.token_ids
        for (_, top_a), (_, top_b) in zip(a.logprobs, b.logprobs):
            common = [t for t in top_a if t in top_b]  # a near tie at the fifth may swap
            assert len(common) >= 4
            worst = max(worst, max(abs(top_a[t] - top_b[t]) for t in common))
    return worst


@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_two_ranks_generate_the_tokens_and_logprobs_of_one_process(arch, split):
    mt, path, one = arch
    two, comm = _run(path, **{split: 2})
    worst = _same(one, two)
    print(f"{mt} {split} 2: max top-5 logprob diff {worst:.2e}")
    assert worst < 1e-4, worst
    assert comm["steps"] >= NEW
    if split == "tensor_parallel_size":
        # per step and layer: o_proj's and the FFN's all-reduces, OLMoE's q/k norms' one more;
        # per step the embedding's all-reduce and the logits' gather
        per_layer = 3 if mt == "olmoe" else 2
        assert comm["comm_calls"] == comm["steps"] * (per_layer * BASE["num_hidden_layers"] + 2)


def test_an_unsupported_architecture_is_refused_by_name_in_one_line(tmp_path):
    """Every architecture the runtime serves splits; the others are refused as in one process,
    before any worker starts."""
    cfg = AutoConfig.for_model("gemma", **BASE)  # Gemma 1: not served
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ArtifactError, match="model_type 'gemma' is not supported") as e:
        LLM(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2)
    assert "\n" not in str(e.value)


# -- each rank's slices, without processes ------------------------------------------------------


def _phi3_artifact(out, fmt: str):
    """The tiny Phi-3 with every decoder Linear (fused qkv_proj, gate_up_proj included)
    quantized to 4 bits in groups of 32, asymmetric (zero points packed along N), as `fmt`."""
    from slimserve.compress.export.formats import export_artifact
    from slimserve.compress.quant.primitives import quantize_weight
    from slimserve.runtime.artifact.manifest import ArtifactManifest
    from slimserve.runtime.artifact.scheme import QuantArgs
    from slimserve.runtime.corpus import read_texts
    from tests.helpers.tiny_model import tiny_tokenizer

    _save("phi3", out / "base")
    model = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.bfloat16).eval()
    args = QuantArgs(4, group_size=32, symmetric=False)
    quantized = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                quantized[name] = qw = quantize_weight(mod.weight, args)
                mod.weight.copy_(qw.dequantize(torch.bfloat16))
    tok = tiny_tokenizer(read_texts("validation")[:2], vocab_size=300)
    manifest = ArtifactManifest(base_model="tiny-phi3")
    return export_artifact(fmt, model, tok, quantized, out / fmt, manifest)


def _weight(m) -> torch.Tensor:
    from slimserve.runtime.layers.quant_linear import QuantLinear

    m = getattr(m, "inner", m)
    return m.dequantized_weight(torch.float32) if isinstance(m, QuantLinear) else m.weight.detach()


def _build(path, rank: int | None):
    from types import SimpleNamespace

    from slimserve.runtime.distributed.loading import TensorShard
    from slimserve.runtime.models.load import build_model

    shard = None
    if rank is not None:  # rank `rank` of 2, less the communicating wrappers
        shard = TensorShard(SimpleNamespace(rank=rank, world=2))
        shard.parallelize = lambda model: None
    return build_model(path, torch.float32, torch.device("cpu"), verify="none", shard=shard).model


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_phi3_fused_rank_slices_are_each_parts_slices(tmp_path, fmt):
    """Rank r's qkv_proj is [q_r; k; v] (the one KV head on both ranks) and its gate_up_proj
    [gate_r; up_r], not rows [r N/2, (r+1) N/2) of the fused tensor."""
    path = _phi3_artifact(tmp_path, fmt)
    full = _build(path, None)
    ranks = [_build(path, r) for r in range(2)]
    q, kv, inter = 64, 16, 128
    for i, layer in enumerate(full.model.layers):
        qkv = _weight(layer.self_attn.qkv_proj)
        gate_up = _weight(layer.mlp.gate_up_proj)
        assert qkv.shape[0] == q + 2 * kv and gate_up.shape[0] == 2 * inter
        for r, m in enumerate(ranks):
            mine = m.model.layers[i]
            half = slice(r * q // 2, (r + 1) * q // 2)
            want = torch.cat([qkv[half], qkv[q : q + kv], qkv[q + kv :]])
            assert torch.equal(_weight(mine.self_attn.qkv_proj), want)
            assert torch.equal(
                _weight(mine.self_attn.o_proj), _weight(layer.self_attn.o_proj)[:, half]
            )
            h = slice(r * inter // 2, (r + 1) * inter // 2)
            want = torch.cat([gate_up[:inter][h], gate_up[inter:][h]])
            assert torch.equal(_weight(mine.mlp.gate_up_proj), want)
            assert torch.equal(_weight(mine.mlp.down_proj), _weight(layer.mlp.down_proj)[:, h])
