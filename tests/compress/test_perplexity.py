"""Perplexity harness against a hand-computed NLL on a tiny random Llama."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slimserve.compress.perplexity import PerplexityResult, evaluate_perplexity, perplexity_on

SEQ = 16


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(
        0, 256, (5 * SEQ + 7,), generator=torch.Generator().manual_seed(1)
    )  # 7 dropped


def reference_nll(model, tokens, seq_len, windows):
    """Mean NLL of tokens 1..seq_len-1 of each window, one window at a time, fp32."""
    losses = []
    with torch.no_grad():
        for w in range(windows):
            x = tokens[w * seq_len : (w + 1) * seq_len][None]
            logits = model(x).logits.float()
            losses.append(F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none"))
    return torch.cat(losses).double().mean().item()


def test_matches_hand_computed_nll(model, tokens):
    res = evaluate_perplexity(
        model, tokens, seq_len=SEQ, batch_size=2, progress=False, dataset="toy"
    )
    ref = reference_nll(model, tokens, SEQ, 5)
    # fp32 log-softmax over V=256 summed over 75 tokens: agreement to ~1e-6 relative; 1e-5 is slack
    assert res.nll_mean == pytest.approx(ref, rel=1e-5)
    assert res.ppl == pytest.approx(math.exp(ref), rel=1e-5)
    assert (res.windows, res.tokens, res.seq_len, res.dataset) == (5, 5 * (SEQ - 1), SEQ, "toy")
    assert 100 < res.ppl < 1000  # a random model over 256 symbols sits near ppl 256


def test_max_windows_takes_first_windows(model, tokens):
    res = evaluate_perplexity(
        model, tokens, seq_len=SEQ, max_windows=2, batch_size=8, progress=False
    )
    assert (res.windows, res.tokens) == (2, 2 * (SEQ - 1))
    assert res.nll_mean == pytest.approx(reference_nll(model, tokens, SEQ, 2), rel=1e-5)
    more = evaluate_perplexity(model, tokens, seq_len=SEQ, max_windows=99, progress=False)
    assert more.windows == 5


def test_deterministic_and_batch_size_independent(model, tokens):
    a = evaluate_perplexity(model, tokens, seq_len=SEQ, batch_size=1, progress=False)
    b = evaluate_perplexity(model, tokens, seq_len=SEQ, batch_size=1, progress=False)
    c = evaluate_perplexity(model, tokens, seq_len=SEQ, batch_size=4, progress=True)
    assert a.nll_mean == b.nll_mean
    assert c.nll_mean == pytest.approx(a.nll_mean, rel=1e-5)


def test_bf16_model_keeps_dtype_and_mode(tokens):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    res = evaluate_perplexity(m, tokens, seq_len=SEQ, progress=False)
    assert math.isfinite(res.ppl)
    assert m.training and next(m.parameters()).dtype == torch.bfloat16


class InputIdsOnly(torch.nn.Module):
    """A forward that takes `input_ids` only and returns bare logits: uniform over 8 symbols."""

    def forward(self, input_ids):
        return torch.zeros(*input_ids.shape, 8)


def test_plain_module_uniform_logits():
    res = evaluate_perplexity(InputIdsOnly(), torch.arange(40) % 8, seq_len=10, progress=False)
    assert res.ppl == pytest.approx(8.0, rel=1e-6)
    assert (res.windows, res.tokens) == (4, 36)


def test_bad_arguments_raise():
    m = InputIdsOnly()
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate_perplexity(m, torch.arange(5), seq_len=10, progress=False)
    with pytest.raises(ValueError, match="seq_len=1"):
        evaluate_perplexity(m, torch.arange(5), seq_len=1, progress=False)
    with pytest.raises(ValueError, match="max_windows=0"):
        evaluate_perplexity(m, torch.arange(50), seq_len=10, max_windows=0, progress=False)


def test_to_dict_and_perplexity_on(model, tmp_path):
    class ByteTokenizer:
        eos_token_id = 0

        def __call__(self, texts, add_special_tokens=True):
            return {"input_ids": [list(t.encode()) for t in texts]}

    f = tmp_path / "t.txt"
    f.write_text("the quick brown fox jumps over the lazy dog " * 3)
    res = perplexity_on(
        model, ByteTokenizer(), f"text:{f}", seq_len=SEQ, max_windows=3, progress=False
    )
    assert isinstance(res, PerplexityResult) and res.windows == 3
    d = res.to_dict()
    assert set(d) == {"ppl", "nll_mean", "tokens", "windows", "seconds", "dataset", "seq_len"}
    assert d["dataset"] == f"text:{f.resolve()}"
