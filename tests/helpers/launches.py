"""Count the kernel launches of a forward on CPU, per decoder layer, op by op.

What counts as one launch (what a GPU would run as one kernel):
- one Triton kernel launch (`kernel[grid](...)`): counted by wrapping the launch entry points
  (`InterpretedFunction.run` under TRITON_INTERPRET=1, `JITFunction.run` on a GPU). The torch
  ops the interpreter itself runs to emulate the kernel (host copies of the arguments) are not
  counted: they are the kernel;
- one aten op dispatch that computes or copies data (`TorchDispatchMode`): a GEMM, an
  elementwise op, a cat, an index, a copy, a reduction. Pure metadata ops (views: view,
  reshape's view, as_strided, slice, select, expand, t/transpose/permute, (un)squeeze, split,
  chunk, unbind, detach, alias) and uninitialized allocations (empty, empty_like,
  empty_strided, new_empty) launch nothing and are not counted.

Split-K / split-context reduction passes (a second kernel that sums fp32 partials) are counted
and shown, but kept apart from the per-layer budget (`REDUCTION_KERNELS`), as issue 12 says.
Launches are attributed to the decoder layer whose forward is running (forward hooks), or to
"model" (embedding, per-step RoPE tables, final norm, lm_head).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# aten overload packets that launch no kernel: views and metadata changes, uninitialized memory
METADATA_OPS = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten._reshape_alias,
        aten.as_strided,
        aten.slice,
        aten.select,
        aten.expand,
        aten.t,
        aten.transpose,
        aten.permute,
        aten.unsqueeze,
        aten.squeeze,
        aten.split,
        aten.split_with_sizes,
        aten.chunk,
        aten.unbind,
        aten.detach,
        aten.alias,
        aten.view_as,
        aten.lift_fresh,
        aten.empty,
        aten.empty_like,
        aten.empty_strided,
        aten.new_empty,
        aten.new_empty_strided,
        aten.unflatten,
        aten.flatten,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
        aten.is_contiguous,
        aten.dim,
        aten.size,
        aten.stride,
        aten.numel,
    }
)

# second passes of split-K GEMMs and split-context attention: outside the per-layer budget
REDUCTION_KERNELS = frozenset({"triton._splitk_reduce_kernel", "triton._reduce_kernel"})


class LaunchCounter(TorchDispatchMode):
    """Records (scope, op) for every launch while active; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str]] = []
        self.scope = "model"
        self._in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_kernel:
            return func(*args, **kwargs)
        # Composite ops (linear, reshape, to, ...) can reach the mode whole, in inference mode:
        # count what they decompose into (a `to` that changes nothing, a reshape that is a view,
        # launch nothing; linear is one addmm/mm).
        with self:
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
        if func.overloadpacket not in METADATA_OPS:
            self.records.append((self.scope, f"aten.{func.overloadpacket.__name__}"))
        return func(*args, **kwargs)

    def kernel_launch(self, name: str) -> None:
        self.records.append((self.scope, f"triton.{name}"))

    def per_scope(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for scope, op in self.records:
            out.setdefault(scope, Counter())[op] += 1
        return out

    def ops(self, scope: str) -> list[str]:
        """Launches of `scope` in execution order."""
        return [op for s, op in self.records if s == scope]


def budget_launches(ops: list[str]) -> int:
    """Launches that count against the per-layer budget (reduction passes excluded)."""
    return sum(op not in REDUCTION_KERNELS for op in ops)


def table(ops: list[str]) -> str:
    """One line per launch, in order, reduction passes marked."""
    return "\n".join(
        f"  {i:2d}. {op}{'  (reduction pass, not budgeted)' if op in REDUCTION_KERNELS else ''}"
        for i, op in enumerate(ops, 1)
    )


@contextlib.contextmanager
def count_launches(model: torch.nn.Module):
    """Count the launches of everything run inside; decoder layers of `model` (`model.model.layers`)
    are their own scopes ("layer0", "layer1", ...)."""
    counter = LaunchCounter()
    handles = []
    for i, layer in enumerate(model.model.layers):

        def pre(_m, _a, i=i):
            counter.scope = f"layer{i}"

        def post(_m, _a, _o):
            counter.scope = "model"

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))

    patched = []

    def wrap(cls):
        orig = cls.run

        def run(self, *args, **kwargs):
            fn = getattr(self, "fn", None)
            counter.kernel_launch(getattr(fn, "__name__", None) or getattr(self, "__name__", "?"))
            counter._in_kernel += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                counter._in_kernel -= 1

        cls.run = run
        patched.append((cls, orig))

    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency
        pass
    else:
        wrap(InterpretedFunction)
        wrap(JITFunction)
    try:
        with counter:
            yield counter
    finally:
        for cls, orig in patched:
            cls.run = orig
        for h in handles:
            h.remove()
