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
    layered = layerwise_perplexity(
        model, ids, seq_len=32, max_windows=None, batch_size=2, device=torch.device("cpu")
    )
    assert (layered.windows, layered.tokens) == (whole.windows, whole.tokens) == (5, 5 * 31)
    assert abs(layered.nll_mean - whole.nll_mean) < 1e-5 * whole.nll_mean
    capped = layerwise_perplexity(
        model, ids, seq_len=32, max_windows=3, batch_size=2, device=torch.device("cpu")
    )
    assert capped.windows == 3
    assert all(p.device.type == "cpu" for p in model.parameters())


def _ids(tok):
    torch.manual_seed(0)
    return torch.randint(0, 500, (4 * 32 + 3,))


def test_model_perplexity_reads_layers_from_disk_one_at_a_time(tiny_checkpoint, monkeypatch):
    import slimserve.compress.layerwise_eval as le
    from slimserve.compress.layer_store import LayerStore

    cpu = torch.device("cpu")
    whole = le.model_perplexity(
        str(tiny_checkpoint), _ids, 32, None, 2, cpu, memory="whole", verify="none"
    )
    held, most, notes = set(), [0], []
    load, drop = LayerStore.load, LayerStore.drop

    def counted_load(self, i, *a, **k):
        held.add(i)
        most[0] = max(most[0], len(held))
        return load(self, i, *a, **k)

    def counted_drop(self, i):
        held.discard(i)
        return drop(self, i)

    monkeypatch.setattr(LayerStore, "load", counted_load)
    monkeypatch.setattr(LayerStore, "drop", counted_drop)
    # auto: layers only when the float32 model would not fit; pretend 1 MB is available
    monkeypatch.setattr(le, "available_memory", lambda: 2**20)
    layered = le.model_perplexity(
        str(tiny_checkpoint),
        _ids,
        32,
        None,
        2,
        cpu,
        memory="auto",
        verify="none",
        note=notes.append,
    )
    assert any("one at a time" in n for n in notes) and most[0] == 1 and not held
    assert (layered.windows, layered.tokens) == (whole.windows, whole.tokens)
    assert abs(layered.nll_mean - whole.nll_mean) < 1e-6 * whole.nll_mean
    monkeypatch.setattr(le, "available_memory", lambda: 2**40)  # fits: auto loads it whole
    most[0] = 0
    le.model_perplexity(str(tiny_checkpoint), _ids, 32, 1, 2, cpu, memory="auto", verify="none")
    assert most[0] == 0


def test_layers_mode_names_why_it_cannot(tmp_path):
    import pytest

    from slimserve.compress.layerwise_eval import layers_plan, model_perplexity
    from slimserve.runtime.errors import ArtifactError

    with pytest.raises(ArtifactError, match="not a local checkpoint folder.*--memory whole"):
        model_perplexity(
            str(tmp_path / "nope"), _ids, 32, 1, 1, torch.device("cpu"), memory="layers"
        )
    assert layers_plan("x", "whole") == "memory 'whole' was asked for"
