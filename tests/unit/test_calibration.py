"""The layer-sequential engine replays exactly what the full model computes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimserve.compress.calibration import run_layerwise
from slimserve.compress.errors import UnsupportedModelError
from slimserve.compress.quant.mappings import mapping_for
from slimserve.compress.stage import CompressionState


class _Recorder:
    """A no-op layerwise stage that keeps each layer's replayed output."""

    name = "record"

    def __init__(self):
        self.outputs, self.prefixes = [], []

    def compress_layer(self, ctx):
        self.prefixes.append(ctx.prefix)
        self.outputs.append(torch.cat(ctx.forward()))


def test_layerwise_replay_matches_full_forward(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (5, 24))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states  # embeddings, layer outputs...
    state = CompressionState(model=model, tokenizer=None, storage_dtype=torch.bfloat16, calibration=ids)
    rec = _Recorder()
    run_layerwise(state, rec, batch_size=2)  # batches of 2, 2 and 1 sequences
    assert rec.prefixes == ["model.layers.0", "model.layers.1"]
    # Layer 0's output is hidden_states[1]; the last entry of hidden_states has the final norm applied.
    torch.testing.assert_close(rec.outputs[0], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.norm(rec.outputs[1]), ref[2], rtol=1e-5, atol=1e-5)


def test_unsupported_architecture_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        mapping_for(m)
