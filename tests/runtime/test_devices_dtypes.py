"""The runtime's device and dtype resolution (shared with compress, which words its own errors)."""

import pytest
import torch

from slimserve.runtime.devices import DeviceUnavailableError, resolve_device
from slimserve.runtime.dtypes import DTYPES, resolve_dtype, torch_dtype


def test_resolve_device(monkeypatch):
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == here
    assert resolve_device("auto", auto=torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError,
                       match=r"^device: 'cuda:0' asked for but no CUDA device is visible; use --device cpu$"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(DeviceUnavailableError, match=r"'cuda:1' asked for but only 1 CUDA device is "
                                                     r"visible; use cuda:0$"):
        resolve_device("cuda:1")


def test_torch_dtype_and_resolve_dtype():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("torch.float16") is torch.float16
    assert torch_dtype(torch.float32) is torch.float32 and torch_dtype(None) is None
    assert torch_dtype("nn") is None and torch_dtype("nope") is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, torch.bfloat16) is torch.float32
    assert resolve_dtype("auto", cuda, torch.float16) is torch.float16
    assert resolve_dtype("auto", cuda, torch.float32) is torch.bfloat16
    assert resolve_dtype("float16", cpu, None) is DTYPES["float16"]
    with pytest.raises(ValueError, match=r"^dtype: 'int8' is not one of auto, float16, bfloat16, float32$"):
        resolve_dtype("int8", cpu, None)
