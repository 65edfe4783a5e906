"""`compress run` on Gemma 2 and Phi-3 (compress/mappings.py `_GEMMA`, `_PHI3`): rtn and gptq
W4A16 artifacts that our engine serves (runtime/models/gemma.py, runtime/models/phi3.py) with the
tokens transformers computes on the same artifact (`load_model`: transformers' architecture with
the artifact's QuantLinears, loaded strictly).

The checkpoints are tiny and random (bf16, hidden 64, 2 layers) with the tests' tokenizer; Gemma 2
keeps its soft caps and a sliding window shorter than the prompts. Both sides compute in fp32
over the same dequantized weights, so greedy tokens must agree exactly.
"""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from slimserve.compress.errors import RecipeError
from slimserve.compress.mappings import ARCHITECTURES
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.corpus import read_texts
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.layers import QuantLinear
from slimserve.runtime.llm import LLM
from slimserve.runtime.loading.loader import load_model
from tests.helpers.tiny_model import tiny_tokenizer

RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: "text:{cal}", num_samples: 4, seq_len: 48}}
eval: {{dataset: stdlib, seq_len: 48, max_windows: 2, max_ppl_increase: 1000.0}}
stages:
  - {stage}
"""
STAGES = {
    "rtn": "rtn: {scheme: W4A16, group_size: 32, ignore: [lm_head]}",
    "gptq": "gptq: {scheme: W4A16, group_size: 32, ignore: [lm_head]}",
}
ARCH = {
    "gemma2": dict(
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
    ),
    "phi3": dict(original_max_position_embeddings=256),
}
NEW = 10


def _save(mt: str, out):
    tok = tiny_tokenizer(read_texts("validation")[:6])
    cfg = AutoConfig.for_model(
        mt,
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        **ARCH[mt],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1 if p.dim() >= 2 else 0.3)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=[(mt, s) for mt in sorted(ARCH) for s in sorted(STAGES)])
def artifact(request, tmp_path_factory):
    mt, stage = request.param
    tmp = tmp_path_factory.mktemp(f"{mt}-{stage}")
    base = _save(mt, tmp / "base")
    cal = tmp / "calib.txt"
    cal.write_text("\n\n".join(read_texts("train")[:8])[:40_000], encoding="utf-8")
    text = RECIPE.format(model=base, out=tmp / "out", cal=cal, stage=STAGES[stage])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # GPTQ's column loop: tiny ops, faster on one of 2 shared cores
    try:
        res = run_recipe(parse_recipe(text, tmp / "r.yaml"), log=lambda m: None, progress=False)
    finally:
        torch.set_num_threads(threads)
    return mt, stage, res.artifact


def _prompts(tok) -> list[list[int]]:
    texts = read_texts("validation")[6:10]
    return [tok(t)["input_ids"][:n] for t, n in zip(texts, (20, 9, 31, 14))]


def test_served_tokens_equal_transformers_on_the_artifact(artifact):
    mt, stage, path = artifact
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    fused = ("self_attn.qkv_proj", "mlp.gate_up_proj") if mt == "phi3" else ("self_attn.q_proj",)
    for rel in (*fused, "mlp.down_proj"):
        assert f"model.layers.1.{rel}.weight_packed" in names, sorted(names)[:20]
    hf = load_model(path, dtype=torch.float32)
    assert any(isinstance(m, QuantLinear) for m in hf.model.modules())
    prompts = _prompts(hf.tokenizer)
    assert max(map(len, prompts)) > 8  # past the Gemma window
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=16, block_size=8)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == want, (mt, stage)


def test_mappings_leave_out_inexact_smoothing():
    gemma, phi3 = ARCHITECTURES["gemma2"], ARCHITECTURES["phi3"]
    assert ARCHITECTURES["gemma3_text"] is gemma
    # (1 + w) norms cannot absorb a scale by division: only Linear -> Linear mappings
    assert {m.prev for m in gemma.smooth} == {"self_attn.v_proj", "mlp.up_proj"}
    assert gemma.mlp_residual is None
    # fused qkv / gate_up: norm -> fused Linear only
    assert [(m.prev, m.linears) for m in phi3.smooth] == [
        ("input_layernorm", ("self_attn.qkv_proj",)),
        ("post_attention_layernorm", ("mlp.gate_up_proj",)),
    ]
    assert phi3.mlp_residual == "post_attention_layernorm"


@pytest.mark.parametrize("mt,match", [("phi3", "fused qkv_proj"), ("gemma2", "soft-caps")])
def test_kv_cache_stage_refuses_what_it_cannot_calibrate(tmp_path, mt, match):
    base = _save(mt, tmp_path / "base")
    text = RECIPE.format(
        model=base, out=tmp_path / "out", cal="x", stage="kv_cache: {dtype: fp8_e4m3}"
    )
    with pytest.raises(RecipeError, match=match) as e:
        run_recipe(parse_recipe(text, tmp_path / "r.yaml"), log=lambda m: None, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
