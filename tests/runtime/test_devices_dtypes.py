"""The runtime's device and dtype resolution (shared with compress, which words its own errors)."""

import pytest
import torch

from slimserve.runtime import dtypes
from slimserve.runtime.devices import DeviceUnavailableError, resolve_device
from slimserve.runtime.dtypes import DTYPES, native_bf16_in, resolve_dtype, torch_dtype


def test_resolve_device(monkeypatch):
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("auto") == here
    assert resolve_device("auto", auto=torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        DeviceUnavailableError,
        match=r"^device: 'cuda:0' asked for but no CUDA device is visible; use --device cpu$",
    ):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(
        DeviceUnavailableError,
        match=r"'cuda:1' asked for but only 1 CUDA device is "
        r"visible; use cuda:0$",
    ):
        resolve_device("cuda:1")


def test_torch_dtype_and_resolve_dtype(monkeypatch):
    assert (
        torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("torch.float16") is torch.float16
    )
    assert torch_dtype(torch.float32) is torch.float32 and torch_dtype(None) is None
    assert torch_dtype("nn") is None and torch_dtype("nope") is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu, torch.bfloat16) is torch.float32
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: True)  # the CPU's fastest dtype
    assert resolve_dtype("auto", cpu, torch.float32) is torch.bfloat16
    assert resolve_dtype("auto", cpu, torch.float16) is torch.bfloat16
    assert resolve_dtype("float32", cpu, torch.bfloat16) is torch.float32  # asked for: kept
    assert resolve_dtype("auto", cuda, torch.float16) is torch.float16
    assert resolve_dtype("auto", cuda, torch.float32) is torch.bfloat16
    assert resolve_dtype("float16", cpu, None) is DTYPES["float16"]
    with pytest.raises(
        ValueError, match=r"^dtype: 'int8' is not one of auto, float16, bfloat16, float32$"
    ):
        resolve_dtype("int8", cpu, None)


def test_native_bf16_from_cpuinfo():
    zen4 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    zen3 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"
    sapphire = "flags\t\t: avx512f amx_bf16 amx_tile\n"
    graviton3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert native_bf16_in(zen4) and native_bf16_in(sapphire) and native_bf16_in(graviton3)
    assert (
        not native_bf16_in(zen3)
        and not native_bf16_in("")
        and not native_bf16_in("model name: x\n")
    )
