"""Dtype names as flags, recipes and config.json spell them, and the dtype a checkpoint names."""

from __future__ import annotations

from pathlib import Path

import torch

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


def resolve_dtype(name: str, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA; fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
