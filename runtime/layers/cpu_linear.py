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

Row buckets: oneDNN builds (JIT-compiles) a primitive for every new input row count M and keeps
up to 1,024 in a cache. A serving step's M is its token count, which takes hundreds of values
(every decode batch size, every prompt-chunk length), so a fresh server spent ~0.6 ms per new M
per Linear shape (measured: M = 1..300, bf16 2048x384, 2 threads: 286 ms first time, 110 ms
again) and a busy one, with 5 shapes x ~2,000 M values, would overflow the cache. `PackedLinear`
therefore pads M up to a bucket (`bucket_rows`: multiples of 8 to 64, of 16 to 256, of 32 to
1,024, of 128 beyond), ~50 primitives per shape up to 2,048 rows, and `warm_up` builds the small
ones at start-up. The padded rows are zeros and their outputs are dropped.
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
        return torch.allclose(
            got.float(), nn.functional.linear(x, w, b).float(), rtol=tol, atol=tol
        )
    except (RuntimeError, AttributeError):
        return False


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 or bf16 weight in oneDNN's layout (an opaque mkldnn tensor of the same size)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)


# (largest M of the step, multiple it is rounded up to)
_BUCKET_STEPS = ((64, 8), (256, 16), (1024, 32), (None, 128))
WARM_UP_ROWS = (
    512  # `warm_up` builds the buckets up to this many rows; larger steps cost more than a build
)


def bucket_rows(rows: int) -> int:
    """The padded row count for a GEMM of `rows` rows (see the module docstring)."""
    for limit, step in _BUCKET_STEPS:
        if limit is None or rows <= limit:
            return -(-rows // step) * step
    raise AssertionError("unreachable")


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
        rows = x.numel() // self.in_features
        padded = bucket_rows(rows)
        if padded == rows:
            return linear(x, self.packed, self.bias)
        flat = x.reshape(rows, self.in_features)
        full = torch.cat([flat, flat.new_zeros(padded - rows, self.in_features)])
        return linear(full, self.packed, self.bias)[:rows].view(*x.shape[:-1], self.out_features)

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
            if (
                type(child) is nn.Linear
                and child.weight.device.type == "cpu"
                and child.weight.dtype == dtype
            ):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count


def warm_up(model: nn.Module, max_rows: int) -> int:
    """Run one PackedLinear of each shape in `model` at every row bucket up to
    min(max_rows, WARM_UP_ROWS), so oneDNN builds those primitives now rather than during the
    first requests. Returns the number of GEMMs run."""
    shapes: dict[tuple, PackedLinear] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            shapes.setdefault(
                (m.in_features, m.out_features, m.bias is not None, m.packed.dtype), m
            )
    buckets = sorted({bucket_rows(r) for r in range(1, min(max_rows, WARM_UP_ROWS) + 1)})
    with torch.inference_mode():
        for (k, _, _, dtype), m in shapes.items():
            for rows in buckets:
                m(torch.zeros(rows, k, dtype=dtype))
    return len(shapes) * len(buckets)
