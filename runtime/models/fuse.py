"""Fuse Linears that read the same input into one (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

One GEMM instead of three (or two) per layer: fewer kernel launches on GPUs, better-shaped
matmuls on CPUs. Done after the weights are loaded, so artifacts keep transformers' names.
Quantized layers fuse when their formats line up: same scheme and format, same g_idx (GPTQ's
act-order permutation comes from the shared input's Hessian, so q/k/v agree), and asymmetric
zero points (packed along N) only when every part's rows fill whole int32 words.
"""

from __future__ import annotations

import torch
from torch import nn

from slimserve.runtime.layers.quant_linear import PACKED, QuantLinear
from slimserve.runtime.models.moe import ExpertMLP


class FusedLinear(nn.Module):
    """One Linear computing several outputs: y = cat(W_i) x, split by `sizes` afterwards."""

    def __init__(self, inner: nn.Module, sizes: list[int]):
        super().__init__()
        self.inner = inner  # nn.Linear or QuantLinear with out_features = sum(sizes)
        self.sizes = sizes  # output features of each fused projection, in order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _cat_dense(parts: list[nn.Linear]) -> nn.Linear:
    first = parts[0]
    out = sum(p.out_features for p in parts)
    fused = nn.Linear(
        first.in_features,
        out,
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def _fusable_quant(parts: list[QuantLinear]) -> bool:
    first = parts[0]
    if any(
        p.scheme != first.scheme
        or p.ct_format != first.ct_format
        or p.storage_dtype != first.storage_dtype
        or (p.bias is None) != (first.bias is None)
        for p in parts
    ):
        return False
    if first.weight_g_idx is not None and any(
        not torch.equal(p.weight_g_idx, first.weight_g_idx) for p in parts
    ):
        return False
    if first.scheme.weights.strategy == "tensor":
        return False  # one scale per tensor cannot hold several tensors' scales
    bits = first.scheme.weights.num_bits
    if first.ct_format == PACKED and first.weight_zero_point is not None:
        return all(p.out_features * bits % 32 == 0 for p in parts)
    return True


def _cat_quant(parts: list[QuantLinear]) -> QuantLinear:
    first = parts[0]
    out = sum(p.out_features for p in parts)
    fused = QuantLinear(
        first.in_features,
        out,
        first.bias is not None,
        first.scheme,
        first.ct_format,
        dtype=first.weight_scale.dtype,
        device=first.weight_scale.device,
    )
    fused.storage_dtype = first.storage_dtype
    state = {}
    for name, _buf in fused.named_buffers():
        if name == "weight_shape":
            state[name] = torch.tensor([out, first.in_features], dtype=torch.int64)
        elif name == "weight_g_idx":
            state[name] = first.weight_g_idx
        else:  # weight(_packed), weight_scale, weight_zero_point, bias: all stacked along N
            state[name] = torch.cat([getattr(p, name) for p in parts])
    fused.load_state_dict(state, strict=True)
    return fused


def fuse_linears(parts: list[nn.Module]) -> FusedLinear | None:
    """A FusedLinear of `parts` (same input), or None when their formats do not line up."""
    if all(type(p) is nn.Linear for p in parts):
        return FusedLinear(_cat_dense(parts), [p.out_features for p in parts])
    if all(isinstance(p, QuantLinear) for p in parts) and _fusable_quant(parts):
        return FusedLinear(_cat_quant(parts), [p.out_features for p in parts])
    return None


def fuse_projections(model: nn.Module) -> int:
    """Fuse every decoder layer's q/k/v and gate/up projections (each expert's too, in a
    mixture of experts) where possible; returns how many fusions were made. The originals are
    removed (their memory is freed)."""
    count = 0
    for layer in model.model.layers:
        ffn = getattr(layer, "ffn", None) or layer.mlp
        groups = [
            (layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (ffn, ("gate_proj", "up_proj"), "gate_up_proj"),
        ]
        groups += [
            (m, m.names[:2], "gate_up_proj") for m in ffn.modules() if isinstance(m, ExpertMLP)
        ]
        for parent, names, fused_name in groups:
            if not all(hasattr(parent, n) for n in names):
                continue
            fused = fuse_linears([getattr(parent, n) for n in names])
            if fused is None:
                continue
            for n in names:
                delattr(parent, n)
            setattr(parent, fused_name, fused)
            count += 1
    return count
