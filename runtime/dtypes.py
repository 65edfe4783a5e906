"""Dtype names as flags, recipes and config.json spell them, and the dtype a checkpoint names."""

from __future__ import annotations

from pathlib import Path

import torch

from slimserve.kernels.cpu_info import cpu_flags, host_cpu_flags

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def torch_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """`value` as a torch dtype: a dtype as is, a name ("bfloat16" or "torch.bfloat16") looked up
    in torch; None for None or for a name that is not a torch dtype."""
    if value is None or isinstance(value, torch.dtype):
        return value
    resolved = getattr(torch, str(value).removeprefix("torch."), None)
    return resolved if isinstance(resolved, torch.dtype) else None


def checkpoint_dtype(model: str | Path) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (`dtype`, or the older `torch_dtype`), None if none."""
    from transformers import AutoConfig

    return torch_dtype(getattr(AutoConfig.from_pretrained(model), "dtype", None))


# /proc/cpuinfo flags of CPUs with bf16 dot-product instructions (x86: AVX512-BF16, AMX; Arm: the
# BF16 extension), on which oneDNN runs bf16 matmuls natively instead of emulating them.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (Linux: its /proc/cpuinfo flags; False elsewhere)."""
    return not NATIVE_BF16_FLAGS.isdisjoint(host_cpu_flags())


def native_bf16_in(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text's flags (`cpu_flags`) name a native bf16 extension."""
    return not NATIVE_BF16_FLAGS.isdisjoint(cpu_flags(cpuinfo))


def resolve_dtype(name: str, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA (bf16 for an fp32 one); on CPU bf16 where the CPU
    multiplies bf16 natively (`cpu_has_native_bf16`: its Linears run 1.3-2.3x faster than fp32),
    else fp32 (emulated bf16 matmuls are slower than fp32)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
