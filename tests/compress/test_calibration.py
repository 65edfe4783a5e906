"""The layer-sequential engine replays exactly what the full model computes."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimserve.compress.calibration import run_layerwise
from slimserve.compress.errors import UnsupportedModelError
from slimserve.compress.mappings import mapping_for
from slimserve.compress.stage import CompressionState, Stage


class _Recorder(Stage):
    """A no-op layerwise stage that keeps each layer's replayed output."""

    name, layerwise = "record", True

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
    state = CompressionState(
        model=model, tokenizer=None, storage_dtype=torch.bfloat16, calibration=ids
    )
    rec = _Recorder()
    run_layerwise(state, rec, batch_size=2)  # batches of 2, 2 and 1 sequences
    assert rec.prefixes == ["model.layers.0", "model.layers.1"]
    # Layer 0's output is hidden_states[1]; the last entry of hidden_states has the final norm applied.
    torch.testing.assert_close(rec.outputs[0], ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.model.norm(rec.outputs[1]), ref[2], rtol=1e-5, atol=1e-5)


def test_unsupported_architecture_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, mistral, .*qwen2, .*qwen3"):
        mapping_for(m)


class _StopAfterQkv(Stage):
    """Replays up to q/k/v only, then once in full; counts the calls of q_proj and o_proj."""

    name, layerwise = "stop", True

    def __init__(self):
        self.calls, self.results = {"q": 0, "o": 0}, []

    def compress_layer(self, ctx):
        attn = ctx.module("self_attn")
        hooks = [
            attn.q_proj.register_forward_hook(
                lambda *a: self.calls.__setitem__("q", self.calls["q"] + 1)
            ),
            attn.o_proj.register_forward_hook(
                lambda *a: self.calls.__setitem__("o", self.calls["o"] + 1)
            ),
        ]
        self.results.append(ctx.forward(stop_after=[attn.q_proj, attn.k_proj, attn.v_proj]))
        self.results.append(dict(self.calls))
        self.results.append(len(ctx.forward()))
        for h in hooks:
            h.remove()


def test_stop_after_skips_the_rest_of_the_layer(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (5, 16))
    state = CompressionState(
        model=model, tokenizer=None, storage_dtype=torch.bfloat16, calibration=ids
    )
    stage = _StopAfterQkv()
    run_layerwise(state, stage, batch_size=2)  # 3 batches per replay
    # layer 0: the stopped replay ran q_proj 3 times and never reached o_proj; the full one did
    assert stage.results[:3] == [[], {"q": 3, "o": 0}, 3]
    assert stage.calls == {"q": 12, "o": 6}  # two layers, two replays each


class _Stats(Stage):
    name, layerwise, replay_in_storage_dtype = "stats", True, True


class _Search(Stage):
    name, layerwise = "search", True


@pytest.mark.parametrize(
    "setting,storage,device,stage,expected",
    [
        (
            "auto",
            torch.bfloat16,
            "cpu",
            _Stats(),
            torch.bfloat16,
        ),  # statistics in the checkpoint's dtype
        ("auto", torch.bfloat16, "cpu", _Search(), None),  # searches compare outputs in float32
        ("auto", torch.float16, "cpu", _Stats(), None),  # fp16 matmuls are slow on CPUs
        ("auto", torch.float16, "cuda", _Stats(), torch.float16),
        ("auto", torch.float32, "cpu", _Stats(), None),
        ("float16", torch.bfloat16, "cpu", _Search(), torch.float16),  # explicit: every stage
        ("float32", torch.bfloat16, "cpu", _Stats(), None),
    ],
)
def test_replay_dtype(setting, storage, device, stage, expected):
    from slimserve.compress.calibration import replay_dtype

    state = CompressionState(
        model=None, tokenizer=None, storage_dtype=storage, calibration_dtype=setting
    )
    assert replay_dtype(state, stage, torch.device(device)) is expected


def test_bf16_replay_tracks_the_fp32_one_and_restores_the_layers(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (4, 24))
    outs = {}
    for setting in ("float32", "bfloat16"):
        state = CompressionState(
            model=model,
            tokenizer=None,
            storage_dtype=torch.bfloat16,
            calibration=ids,
            calibration_dtype=setting,
        )
        rec = _Recorder()
        run_layerwise(state, rec, batch_size=2)
        outs[setting] = rec.outputs[-1]
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert outs["bfloat16"].dtype == torch.bfloat16
    ref = outs["float32"]
    torch.testing.assert_close(
        outs["bfloat16"].float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item()
    )


class _Writer(Stage):
    """Writes a bf16-exact value into q_proj (as GPTQ writes fake-quantized weights)."""

    name, layerwise = "write", True

    def compress_layer(self, ctx):
        w = ctx.module("self_attn.q_proj").weight
        assert w.dtype == torch.bfloat16
        w.data.fill_(0.375)


def test_bf16_replay_writes_back_into_the_same_fp32_storage(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    state = CompressionState(
        model=model,
        tokenizer=None,
        storage_dtype=torch.bfloat16,
        calibration=torch.randint(0, 100, (2, 8)),
        calibration_dtype="bfloat16",
    )
    run_layerwise(state, _Writer())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # no reallocation
    for layer in model.model.layers:
        w = layer.self_attn.q_proj.weight
        assert w.dtype == torch.float32 and torch.all(w == 0.375)


class _Registers(Stage):
    """Registers a buffer during the replay, as the kv_cache stage does with k_scale/v_scale."""

    name, layerwise = "register", True

    def compress_layer(self, ctx):
        attn = ctx.module("self_attn")
        ref = attn.q_proj.weight
        attn.register_buffer(
            "k_scale", torch.tensor([0.5], dtype=ref.dtype, device=ref.device), persistent=False
        )


def test_buffers_registered_in_a_replay_come_home(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    state = CompressionState(
        model=model,
        tokenizer=None,
        storage_dtype=torch.bfloat16,
        calibration=torch.randint(0, 100, (2, 8)),
        calibration_dtype="bfloat16",
    )
    run_layerwise(state, _Registers())
    for layer in model.model.layers:
        b = layer.self_attn.k_scale
        assert (b.dtype, b.device.type, b.item()) == (torch.float32, "cpu", 0.5)
