"""Model-size facts the pipeline and the stages report: parameter counts and weight bytes."""

from __future__ import annotations

import torch
from torch import nn

from slimserve.runtime.artifact.qweight import QuantizedWeight


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied ones once)."""
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())


def weight_bytes(
    model: nn.Module, quantized: dict[str, QuantizedWeight], storage: torch.dtype
) -> int:
    """Bytes the model's weights take on disk: packed codes + scales for quantized Linears."""
    total, seen = 0, set()
    elem = torch.empty(0, dtype=storage).element_size()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            qw = quantized.get(mod_name) if p_name == "weight" else None
            if qw is None:
                total += p.numel() * elem
                continue
            n, k = qw.shape
            total += n * k * qw.args.num_bits // 8 + qw.scale.numel() * elem
            if qw.zero_point is not None:
                total += qw.zero_point.numel() * qw.args.num_bits // 8
    return total
