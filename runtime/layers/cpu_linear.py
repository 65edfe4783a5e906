"""Dense Linears on CPU through oneDNN, with each weight reordered once at load.

`F.linear` hands MKL the row-major weight on every call. oneDNN's inner product over a weight
reordered ahead of time into its own blocked layout runs this engine's GEMMs faster on CPU: on
an AVX2 EPYC, 1.3-2x at decoding batch sizes (M = 4..64, the demo model's shapes) and ~1.15x at
prefill sizes, with the same fp32 math in another summation order (measured when this was
added, `torch.ops.mkldnn` against `F.linear`). It is what torch.compile's CPU freezing pass does
with Linears. The two ops are private torch API, so `available` tries them once and the
engine keeps `F.linear` when they are missing or disagree with it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

_BATCH_HINT = 256  # oneDNN picks the reordered layout for this many rows; any M runs on it


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether reordered oneDNN Linears run here for `dtype` (fp32 only: bf16 and fp16 are
    emulated on CPUs without native support, and are not what the CPU path computes in)."""
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
        x = torch.randn(5, 40, generator=g)
        got = linear(x, reorder(w), b)
        return torch.allclose(got, nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    except (RuntimeError, AttributeError):
        return False


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 weight in oneDNN's layout (an opaque mkldnn tensor of the same size)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ packed^T (+ bias) -> [..., N], like F.linear on the original weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An inference-only nn.Linear whose weight lives reordered for oneDNN."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.register_buffer("packed", reorder(source.weight), persistent=False)
        bias = None if source.bias is None else source.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every plain fp32 CPU nn.Linear in `model` with a PackedLinear (a tied lm_head
    gets its own reordered copy; the embedding keeps the original). Returns how many; 0 when
    `available(dtype)` is false. Call after the projections are fused."""
    if not available(dtype):
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" \
                    and child.weight.dtype == dtype:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
