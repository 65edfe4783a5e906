"""RoPE inverse frequencies and fp8 KV scales stay fp32 whatever the compute dtype, and a long
context decodes like transformers.

Cast to bf16, an inverse frequency keeps 8 significant bits, so the rotation angle at position
~1000 is off by up to ~1000 x 2^-9 x inv_freq: about a radian for the faster frequencies. On
the demo model (max_position_embeddings 1024) that moved the top-5 logprobs at positions
1008-1023 by 0.24 on average against the fp32 model and flipped 4 of 16 greedy choices that
transformers-bf16 makes with a clear margin; with fp32 frequencies the bf16 engine is as close
to fp32 as transformers-bf16 is (0.022 vs 0.033 mean). transformers keeps `inv_freq` in fp32 in
any dtype, so it is the reference here.
"""

import pytest
import torch

from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.loading.loader import load_model
from slimserve.runtime.models.llama import CausalLM
from slimserve.runtime.models.load import build_model, random_model
from tests.helpers import DEMO_MODEL, REPO
from tests.helpers.transformers_match import teacher_forced

NEW = 16  # generated tokens; the prompt fills the rest of the 1024 positions


@pytest.fixture(scope="module")
def hf32():
    return load_model(DEMO_MODEL, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt(hf32) -> list[int]:
    """Python source of this repository (the demo model is trained on Python), as long as the
    model's context allows with NEW tokens to generate."""
    limit = hf32.model.config.max_position_embeddings
    text = "".join(
        (REPO / "runtime" / "engine" / f).read_text()
        for f in ("scheduler.py", "block_manager.py", "llm_engine.py")
    )
    ids = hf32.tokenizer(text).input_ids[: limit - NEW]
    assert len(ids) == limit - NEW
    return ids


def _all_fp32(model: CausalLM) -> bool:
    attn = [layer.self_attn for layer in model.model.layers]
    return model.inv_freq.dtype == torch.float32 and all(
        a.k_scale.dtype == torch.float32 and a.v_scale.dtype == torch.float32 for a in attn
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_frequencies_and_kv_scales_stay_fp32(hf32, dtype):
    reference = hf32.model.model.rotary_emb.inv_freq  # transformers' fp32 frequencies
    assert reference.dtype == torch.float32
    built = build_model(DEMO_MODEL, dtype, torch.device("cpu"))
    assert built.model.lm_head.weight.dtype == dtype  # the weights did take the dtype
    assert _all_fp32(built.model)
    assert torch.equal(built.model.inv_freq, reference)
    # the other constructor (benchmarks' random models) and plain casts of the module
    made = random_model(built.spec, dtype, torch.device("cpu"))
    assert made.lm_head.weight.dtype == dtype and _all_fp32(made)
    assert torch.equal(made.inv_freq, reference)
    for cast in (lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.to(torch.float64)):
        m = cast(CausalLM(built.spec))
        assert _all_fp32(m) and torch.equal(m.inv_freq, reference)
    # calibrated fp8 scales keep every bit (a bf16 buffer would round 0.0123 to 0.01232910...)
    attn = built.model.model.layers[0].self_attn
    attn.k_scale.fill_(0.0123)
    assert attn.k_scale.item() == torch.tensor(0.0123).item()


def _engine_greedy(dtype: str, prompt: list[int]):
    """The engine's greedy continuation with its top-5 logprobs; the 1008-token prompt is
    prefilled in two chunks."""
    llm = LLM(str(DEMO_MODEL), dtype=dtype, device="cpu", max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=5, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def _top5(out, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine's, reference's) logprobs [NEW, 5] of the engine's top-5 tokens at each step."""
    ids = [list(top) for _, top in out.logprobs]
    ours = torch.tensor([list(top.values()) for _, top in out.logprobs])
    return ours, torch.stack([lp[j, ids[j]] for j in range(len(ids))])


def test_long_context_fp32_greedy_equals_transformers(hf32, prompt):
    out = _engine_greedy("float32", prompt)
    lp = teacher_forced(hf32.model, prompt, out.token_ids)
    assert out.token_ids == lp.argmax(-1).tolist()  # trained model: margins >> fp32 rounding
    ours, ref = _top5(out, lp)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_long_context_bf16_is_as_close_to_fp32_as_transformers_bf16(hf32, prompt):
    """bf16 engine vs transformers-bf16 on the same tokens. Both round activations differently
    (other kernels, other op order), so greedy can differ where the top two logits are within a
    few bf16 steps (0.0625 at these magnitudes): the argmax must agree wherever
    transformers-bf16's margin is >= 0.25, and the engine's distance to the fp32 model must be
    no worse than transformers-bf16's (measured: 0.022 vs 0.033; bf16 frequencies: 0.24)."""
    out = _engine_greedy("bfloat16", prompt)
    hf16 = load_model(DEMO_MODEL, dtype=torch.bfloat16)
    assert hf16.model.model.rotary_emb.inv_freq.dtype == torch.float32
    lp16 = teacher_forced(hf16.model, prompt, out.token_ids)
    lp32 = teacher_forced(hf32.model, prompt, out.token_ids)
    top2 = lp16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= 0.25
    assert clear.sum() >= NEW // 2  # the check below covers most positions
    greedy16 = lp16.argmax(-1)
    assert [t for t, c in zip(out.token_ids, clear) if c] == greedy16[clear].tolist()
    ours, truth = _top5(out, lp32)
    _, theirs = _top5(out, lp16)
    ours_err, theirs_err = (ours - truth).abs().mean(), (theirs - truth).abs().mean()
    assert ours_err <= 1.5 * theirs_err + 0.01, (float(ours_err), float(theirs_err))
    assert (ours - theirs).abs().mean() < 0.1
