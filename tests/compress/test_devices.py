"""The recipe's compute device: parsed at recipe load, checked for presence at run time."""

import pytest
import torch

from slimserve.compress.devices import parse_device, resolve_device
from slimserve.compress.errors import RecipeError
from slimserve.compress.recipe import parse_recipe


@pytest.mark.parametrize(
    "name,expected",
    [
        ("auto", None),
        ("cpu", torch.device("cpu")),
        ("cuda", torch.device("cuda")),
        ("cuda:1", torch.device("cuda", 1)),
    ],
)
def test_parse_device(name, expected):
    assert parse_device(name, "device") == expected


@pytest.mark.parametrize(
    "name,needle",
    [
        ("gpu", "'gpu' is not a device"),
        ("mps", "'mps' is not supported"),
        ("cuda:x", "'cuda:x' is not a device"),
    ],
)
def test_bad_device_names_the_field(name, needle):
    with pytest.raises(RecipeError, match=f"stages.distill.device: {needle}"):
        parse_device(name, "stages.distill.device")


def test_recipe_device_is_checked_at_load():
    text = "model: m\noutput: o\ndevice: {dev}\nstages:\n  - rtn: {{scheme: W4A16}}\n"
    assert parse_recipe(text.format(dev="cpu")).device == "cpu"
    assert parse_recipe("model: m\noutput: o\nstages:\n  - rtn: {scheme: W4A16}\n").device == "auto"
    with pytest.raises(RecipeError, match="^device: 'tpu' is not a device"):
        parse_recipe(text.format(dev="tpu"))


def test_resolve_device_auto_and_absent_cuda():
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto", "device") == here
    assert resolve_device("auto", "device", auto=torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("cpu", "device") == torch.device("cpu")
    if torch.cuda.is_available():
        with pytest.raises(RecipeError, match="only .* CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}", "device")
    else:
        with pytest.raises(
            RecipeError, match="^device: 'cuda' but no CUDA device is available; use auto or cpu"
        ):
            resolve_device("cuda", "device")


def test_whole_model_evaluation_only_where_it_fits(monkeypatch, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from slimserve.compress.layerwise_eval import whole_model_shortfall

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    weights = sum(p.numel() * 4 for p in model.parameters())
    logits = 3 * 4 * 2 * 64 * model.config.vocab_size  # batch of 2 x 64 tokens
    cuda = torch.device("cuda")
    assert whole_model_shortfall(model, torch.device("cpu"), 2 * 64) == ""
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device: (int(1.2 * (weights + logits)), 2**40)
    )
    assert whole_model_shortfall(model, cuda, 2 * 64) == ""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (weights, 2**40))
    assert "GiB free" in whole_model_shortfall(model, cuda, 2 * 64)
