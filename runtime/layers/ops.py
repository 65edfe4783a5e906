"""The runtime's ops: the Triton kernels on CUDA (or when forced), the torch twins otherwise.

`SLIMSERVE_KERNELS=auto|triton|torch` (kernels/_launch.py) picks the path; `auto` runs the
kernels on CUDA tensors and, on CPU, the pure-torch twins in kernels/reference.py and
kernels/reference_attention.py except where C kernels build (the `CPU` table): the decode rows'
attention (kernels/cpu_attention.py: it reads the paged cache in place where the twin gathers
each context first), RMSNorm, SiLU-and-multiply and RoPE + KV-cache write
(kernels/cpu_layer_ops.py: one pass each).
`torch` is the twins alone: the oracle the kernel tests compare against.

The choice is resolved once, not per op: `select(device)` reads the environment and returns
one of two `KernelOps` tables of plain functions (the kernel modules are imported when the
Triton table is first built), which the model resolves at its first forward and keeps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimserve.kernels import cpu_attention, cpu_layer_ops, reference, reference_attention
from slimserve.kernels._launch import kernel_backend
from slimserve.runtime.batch import BatchInputs


@dataclass(frozen=True)
class KernelOps:
    """One backend's ops, with the signatures of the twins (kernels/reference.py,
    kernels/reference_attention.py), plus the
    step's attention: `plan_attention(batch, block_size)` once per step, then per layer
    `attention(q, k, v, key_cache, value_cache, batch, plan, scale, k_scale, v_scale)` with k/v
    the keys and values just written to the cache.

    A sliding window is planned (`plan_attention(batch, block_size, window=W)`, one plan per
    window a model's layers use) and a soft cap on the scores passed per call
    (`attention(..., softcap=c)`): the torch and CPU tables take both; the Triton table takes
    neither and refuses them (a model that needs them routes its attention to the torch twin on
    CUDA: `twin_attention`)."""

    triton: bool
    rms_norm: Callable
    fused_add_rms_norm: Callable
    silu_and_mul: Callable
    rope_and_write_kv: Callable
    write_kv_cache: Callable
    plan_attention: Callable
    attention: Callable


def _torch_plan(
    batch: BatchInputs, block_size: int, window: int | None = None
) -> reference_attention.AttentionPlan:
    return reference_attention.plan_attention(
        batch.cu_seqlens_q, batch.context_lens, batch.block_tables, block_size, window
    )


def _torch_attention(
    q, k, v, key_cache, value_cache, batch, plan, scale, k_scale, v_scale, softcap=None
):
    return reference_attention.paged_attention(
        q, key_cache, value_cache, plan, scale, k_scale, v_scale, key=k, value=v, softcap=softcap
    )


TORCH = KernelOps(
    triton=False,
    rms_norm=reference.rms_norm,
    fused_add_rms_norm=reference.fused_add_rms_norm,
    silu_and_mul=reference.silu_and_mul,
    rope_and_write_kv=reference_attention.rope_and_write_kv,
    write_kv_cache=reference_attention.write_kv_cache,
    plan_attention=_torch_plan,
    attention=_torch_attention,
)


@dataclass(frozen=True)
class CpuPlan:
    """A step's attention on the CPU table: the leading one-token sequences go to the compiled
    kernel as they are, the rest (prompt chunks, and any one-token sequence after them) to the
    torch twin, planned once here."""

    decodes: int
    rest: reference_attention.AttentionPlan | None  # of the sequences after the decodes
    window: int | None = None  # the sliding window of both parts (None: full attention)


def _cpu_plan(batch: BatchInputs, block_size: int, window: int | None = None) -> CpuPlan:
    nd = batch.num_decodes
    if nd == batch.block_tables.shape[0]:
        return CpuPlan(nd, None, window)
    cu = batch.cu_seqlens_q[nd:]
    return CpuPlan(
        nd,
        reference_attention.plan_attention(
            cu - cu[0], batch.context_lens[nd:], batch.block_tables[nd:], block_size, window
        ),
        window,
    )


def _cpu_attention(
    q, k, v, key_cache, value_cache, batch, plan, scale, k_scale, v_scale, softcap=None
):
    # the runner makes CPU caches the kernel reads (`supports`; model_runner `_kv_dtype`)
    nd = plan.decodes
    decoded = cpu_attention.paged_attention_decode(
        q[:nd],
        key_cache,
        value_cache,
        batch.block_tables[:nd],
        batch.context_lens[:nd],
        scale,
        k_scale,
        v_scale,
        window=plan.window,
        softcap=softcap,
    )
    if plan.rest is None:
        return decoded
    rest = reference_attention.paged_attention(
        q[nd:],
        key_cache,
        value_cache,
        plan.rest,
        scale,
        k_scale,
        v_scale,
        key=k[nd:],
        value=v[nd:],
        softcap=softcap,
    )
    return torch.cat([decoded, rest]) if nd else rest


CPU = dataclasses.replace(
    TORCH,
    rms_norm=cpu_layer_ops.rms_norm,
    fused_add_rms_norm=cpu_layer_ops.fused_add_rms_norm,
    silu_and_mul=cpu_layer_ops.silu_and_mul,
    rope_and_write_kv=cpu_layer_ops.rope_and_write_kv,
    plan_attention=_cpu_plan,
    attention=_cpu_attention,
)


@functools.cache
def triton_ops() -> KernelOps:
    """The Triton table (imports triton and the kernel modules on first use)."""
    from slimserve.kernels import activation, kv_cache, paged_attention, rms_norm, rope_kv_cache

    def decode(q, key_cache, value_cache, batch, n, scale, k_scale, v_scale):
        return paged_attention.paged_attention_decode(
            q,
            key_cache,
            value_cache,
            batch.block_tables[:n],
            batch.context_lens[:n],
            scale,
            k_scale,
            v_scale,
            max_context_len=batch.max_context_len,
        )

    def plan(batch, block_size, window=None):
        if window is not None:
            raise ValueError(
                "the Triton attention kernels take no sliding window; attend through the torch "
                "twin (runtime/layers/ops.py twin_attention)"
            )
        return None

    def attention(
        q, k, v, key_cache, value_cache, batch, plan, scale, k_scale, v_scale, softcap=None
    ):
        if softcap is not None:
            raise ValueError(
                "the Triton attention kernels take no soft cap; attend through the torch twin "
                "(runtime/layers/ops.py twin_attention)"
            )
        if batch.decode_only:
            return decode(q, key_cache, value_cache, batch, q.shape[0], scale, k_scale, v_scale)
        nd = batch.num_decodes  # the leading one-token sequences: tokens 0..nd-1
        prefill = paged_attention.paged_attention_prefill(
            q[nd:],
            key_cache,
            value_cache,
            batch.block_tables[nd:],
            batch.cu_seqlens_q[nd:] - nd if nd else batch.cu_seqlens_q,
            batch.context_lens[nd:],
            scale,
            k_scale,
            v_scale,
            max_q_len=batch.max_q_len,
        )
        if not nd:
            return prefill
        return torch.cat(
            [decode(q[:nd], key_cache, value_cache, batch, nd, scale, k_scale, v_scale), prefill]
        )

    return KernelOps(
        triton=True,
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        silu_and_mul=activation.silu_and_mul,
        rope_and_write_kv=rope_kv_cache.rope_and_write_kv,
        write_kv_cache=kv_cache.write_kv_cache,
        plan_attention=plan,
        attention=attention,
    )


def twin_attention(kops: KernelOps) -> KernelOps:
    """`kops` with the torch twin's attention (planned on the host each step) in place of the
    Triton kernels', for models whose layers need a sliding window or a soft cap on the scores,
    which the Triton kernels do not take; every other op stays. The twin's plan reads the batch
    on the host, so such a model also runs without CUDA graphs (`CUDA_GRAPHS = False` on the
    model, runtime/worker/model_runner.py `_use_cuda_graphs`)."""
    if not kops.triton:
        return kops
    return dataclasses.replace(kops, plan_attention=_torch_plan, attention=_torch_attention)


KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # the Triton kernels' activation dtypes


def triton_enabled(device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether ops on `device` run the Triton kernels (reads SLIMSERVE_KERNELS now): `triton`
    always; `auto` on CUDA for fp16/bf16 compute (`dtype`; None: 16-bit), while an fp32 model
    on CUDA runs the torch twins, since the kernels take 16-bit activations only."""
    backend = kernel_backend()
    if backend == "triton":
        return True
    return (
        backend == "auto"
        and torch.device(device).type == "cuda"
        and (dtype is None or dtype in KERNEL_DTYPES)
    )


def select(device: torch.device, dtype: torch.dtype | None = None) -> KernelOps:
    """The ops for tensors of `dtype` on `device` under the current SLIMSERVE_KERNELS; resolve
    once and keep the result (the model does so at its first forward)."""
    if triton_enabled(device, dtype):
        return triton_ops()
    native = kernel_backend() == "auto" and torch.device(device).type == "cpu"
    return CPU if native and cpu_attention.available() and cpu_layer_ops.available() else TORCH
