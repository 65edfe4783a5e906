"""Shared launcher plumbing: backend choice, argument checks, ahead-of-time compilation.

Every kernel module exposes its launchers plus `aot_variants()`, the list of
(kernel, signature, constexprs, options) it can be launched with; the AOT compile gate in CI
compiles each of them for sm_80 and sm_90 with no GPU present (the interpreter does not enforce
GPU constraints such as shared-memory size or dot shapes, the compiler does).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# Kernel modules with an `aot_variants()` function (explicit registry, no package walking).
AOT_MODULES = (
    "w4a16_gemm",
    "w8a8_gemm",
    "act_quant",
    "kv_cache",
    "rope_kv_cache",
    "paged_attention",
    "rms_norm",
    "activation",
    "fused_moe",
)

_BACKENDS = ("auto", "triton", "torch")
_DEFAULT_SMS = 132  # an H100/H200: the SM count assumed when no GPU is visible (interpreter, AOT)


def kernel_backend() -> str:
    """SLIMSERVE_KERNELS: `auto` (Triton on CUDA tensors, torch otherwise), `triton` (always,
    through the interpreter on CPU: TRITON_INTERPRET=1 must be set before import) or `torch`."""
    value = os.environ.get("SLIMSERVE_KERNELS", "auto").strip().lower()
    if value not in _BACKENDS:
        raise ValueError(f"SLIMSERVE_KERNELS={value!r} is not one of {', '.join(_BACKENDS)}")
    return value


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on tensor `t` runs the Triton kernel (True) or its torch twin (False)."""
    backend = kernel_backend()
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return t.is_cuda


SPLIT_K_WAVES = 2  # split-K GEMMs aim at this many programs per SM (latency hiding for decode)
MIN_K_TILES_PER_SPLIT = 2  # never split K finer than this many block_k steps


def split_k_slices(asked: int, tiles: int, k_tiles: int, device: torch.device) -> int:
    """K slices of a GEMM with `tiles` output tiles and `k_tiles` K steps (W4A16 and W8A8 at
    decode sizes): `asked`, or for 0 as many as bring the programs up to SPLIT_K_WAVES per SM
    with at least MIN_K_TILES_PER_SPLIT steps each; evened out so that no slice is empty."""
    split = asked
    if split == 0:
        want = -(-SPLIT_K_WAVES * num_sms(device) // tiles)
        split = max(1, min(want, k_tiles // MIN_K_TILES_PER_SPLIT))
    per = -(-k_tiles // max(1, min(split, k_tiles)))
    return -(-k_tiles // per)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`, which size split-K / split-context launches;
    off CUDA (interpreter, AOT) an H100/H200's 132, so the choice of path matches the GPU's."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def check(cond: bool, message: str | Callable[[], str]) -> None:
    """Raise ValueError(message) unless `cond`: launchers report what is wrong with an argument.

    `message` may be a callable returning the text, so a launcher on the hot path formats its
    f-string only when the check fails (`check(ok, lambda: f"...")`)."""
    if not cond:
        raise ValueError(message() if callable(message) else message)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(
    name: str,
    t: torch.Tensor | None,
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
    last_contiguous: bool = False,
) -> None:
    """Check a launcher argument; the message names the argument, what it is and what it must be.
    Messages are formatted only on failure (this runs for every argument of every launch)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(_dtype_name(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {_dtype_name(t.dtype)}; expected one of {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        tshape = t.shape
        if len(tshape) != len(shape) or any(
            s is not None and s != d for s, d in zip(shape, tshape)
        ):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} has shape {tuple(tshape)}; expected {want}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if last_contiguous and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dim "
            f"(strides {tuple(t.stride())}); call .contiguous()"
        )


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tl.arange needs power-of-two sizes)."""
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class AotVariant:
    """One way a kernel is launched, for the ahead-of-time compile gate."""

    kernel: Any  # the @triton.jit function (JITFunction or, under the interpreter, its wrapper)
    signature: dict[str, str]  # arg name -> Triton type ("*fp16", "i32", "constexpr", ...)
    constexprs: dict[str, Any]  # constexpr arg name -> value
    options: dict[str, Any] = field(default_factory=dict)  # num_warps, num_stages
    name: str = ""  # readable label for the test id


def aot_compile(variant: AotVariant, capability: int) -> Any:
    """Compile `variant` for CUDA compute capability `capability` (80, 90) without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = variant.kernel
    if not isinstance(fn, JITFunction):  # interpreter mode wraps the function
        fn = JITFunction(fn.fn)
    src = ASTSource(fn=fn, signature=variant.signature, constexprs=variant.constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=variant.options)
