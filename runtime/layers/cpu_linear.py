"""Dense Linears on CPU through oneDNN, with each weight reordered once at load.

`F.linear` hands MKL the row-major weight on every call. oneDNN's inner product over a weight
reordered ahead of time into its own blocked layout runs this engine's GEMMs faster on CPU: on
an AVX2 EPYC, 1.3-2x at decoding batch sizes (M = 4..64, the demo model's shapes) and ~1.15x at
prefill sizes, with the same fp32 math in another summation order (measured when this was
added, `torch.ops.mkldnn` against `F.linear`). It is what torch.compile's CPU freezing pass does
with Linears. On a CPU with native bf16 (AVX512-BF16, AMX) the same ops take bf16 weights,
1.3-2.3x faster than fp32 at the demo model's shapes (Zen 4, 2 threads). The two ops are
private torch API, so `available` tries them once and the engine keeps `F.linear` when they are
missing or disagree with it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from slimserve.runtime.dtypes import cpu_has_native_bf16

_BATCH_HINT = 256  # oneDNN picks the reordered layout for this many rows; any M runs on it


@functools.cache
def available(dtype: torch.dtype) -> bool:
    """Whether reordered oneDNN Linears run here for `dtype`: fp32, and bf16 on CPUs that multiply
    it natively (elsewhere bf16 is emulated; fp16 is not what the CPU path computes in)."""
    native = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())
    if not native or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 40, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
        x = torch.randn(5, 40, generator=g).to(dtype)
        got = linear(x, reorder(w), b)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        return torch.allclose(got.float(), nn.functional.linear(x, w, b).float(), rtol=tol, atol=tol)
    except (RuntimeError, AttributeError):
        return False


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 or bf16 weight in oneDNN's layout (an opaque mkldnn tensor of the same size)."""
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
    """Replace every plain `dtype` CPU nn.Linear in `model` with a PackedLinear (a tied lm_head
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
