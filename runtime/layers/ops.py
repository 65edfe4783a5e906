"""The runtime's ops: the Triton kernel on CUDA (or when forced), the torch twin otherwise.

`SLIMSERVE_KERNELS=auto|triton|torch` (kernels/_launch.py) picks the path; `auto` runs the
kernels on CUDA tensors and the pure-torch twins in kernels/reference.py on CPU, so the CPU path
is exactly the oracle the kernel tests compare against.
"""

from __future__ import annotations

import importlib

import torch

from slimserve.kernels import reference
from slimserve.kernels._launch import use_triton


def _kernel(module: str):
    return importlib.import_module(f"slimserve.kernels.{module}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return _kernel("rms_norm").rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return _kernel("rms_norm").fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return _kernel("activation").silu_and_mul(x)
    return reference.silu_and_mul(x)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    if use_triton(key):
        _kernel("kv_cache").write_kv_cache(key, value, key_cache, value_cache, slot_mapping,
                                           k_scale, v_scale)
    else:
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention_decode(query, key_cache, value_cache, block_tables, context_lens, scale,
                           k_scale, v_scale, max_context_len: int | None = None) -> torch.Tensor:
    if use_triton(query):
        return _kernel("paged_attention").paged_attention_decode(
            query, key_cache, value_cache, block_tables, context_lens, scale, k_scale, v_scale,
            max_context_len=max_context_len)
    return reference.paged_attention_decode(query, key_cache, value_cache, block_tables,
                                            context_lens, scale, k_scale, v_scale)


def paged_attention_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                            context_lens, scale, k_scale, v_scale, max_q_len: int) -> torch.Tensor:
    if use_triton(query):
        return _kernel("paged_attention").paged_attention_prefill(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, scale,
            k_scale, v_scale, max_q_len=max_q_len)
    return reference.paged_attention_prefill(query, key_cache, value_cache, block_tables,
                                             cu_seqlens_q, context_lens, scale, k_scale, v_scale)
