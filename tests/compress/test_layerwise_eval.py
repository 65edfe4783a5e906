"""Layer-at-a-time perplexity equals the whole-model measurement."""

import torch
from transformers import AutoModelForCausalLM

from slimserve.compress.layerwise_eval import layerwise_perplexity
from slimserve.compress.perplexity import evaluate_perplexity


def test_layerwise_perplexity_matches_the_whole_model(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (5 * 32 + 7,))
    whole = evaluate_perplexity(model, ids, seq_len=32, batch_size=2, progress=False)
    layered = layerwise_perplexity(model, ids, seq_len=32, max_windows=None, batch_size=2,
                                   device=torch.device("cpu"))
    assert (layered.windows, layered.tokens) == (whole.windows, whole.tokens) == (5, 5 * 31)
    assert abs(layered.nll_mean - whole.nll_mean) < 1e-5 * whole.nll_mean
    capped = layerwise_perplexity(model, ids, seq_len=32, max_windows=3, batch_size=2, device=torch.device("cpu"))
    assert capped.windows == 3
    assert all(p.device.type == "cpu" for p in model.parameters())
