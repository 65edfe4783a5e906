"""FP8 KV cache inside a transformers model: the attention plug-in `slimserve_fp8kv`.

Registered with transformers' `AttentionInterface`, it fake-quantizes `key_states` /
`value_states` with the attention module's `k_scale` / `v_scale` buffers and then runs the sdpa
implementation, so perplexity measured in the compression pipeline and after `load_model` (HF
path) both see fp8 KV. `install_kv_scales` sets those buffers and selects that implementation.
"""

from __future__ import annotations

import torch
from torch import nn

from slimserve.runtime.artifact.kv_scales import fp8_e4m3_roundtrip

KV_ATTENTION = "slimserve_fp8kv"  # name registered with transformers' AttentionInterface


def fp8kv_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs):
    """sdpa attention on fp8-round-tripped K and V ([batch, kv_heads, seq, head_dim]).

    A module without `k_scale`/`v_scale` buffers (a layer not calibrated yet) gets plain sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_scale, v_scale = getattr(module, "k_scale", None), getattr(module, "v_scale", None)
    if k_scale is not None and v_scale is not None:
        key, value = fp8_e4m3_roundtrip(key, k_scale), fp8_e4m3_roundtrip(value, v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_fp8kv_attention() -> str:
    """Register `slimserve_fp8kv` (attention + sdpa-style mask) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(KV_ATTENTION, fp8kv_attention_forward)
    AttentionMaskInterface.register(KV_ATTENTION, sdpa_mask)
    return KV_ATTENTION


def use_fp8kv_attention(model: nn.Module) -> None:
    """Route every attention call of `model` through `slimserve_fp8kv` (sdpa underneath, whatever
    implementation the model used before; masks are built as for sdpa)."""
    register_fp8kv_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(KV_ATTENTION)
    else:
        model.config._attn_implementation = KV_ATTENTION


def set_kv_scale_buffers(attn: nn.Module, k_scale: float, v_scale: float) -> None:
    """Give an attention module its `k_scale`/`v_scale` buffers ([1], the module's dtype).

    Non-persistent: the exporter writes them from `CompressionState.kv_scales`, not the state dict.
    """
    # Model dtype and device, from a float parameter or (QuantLinear holds buffers) buffer.
    ref = next(t for t in (*attn.parameters(), *attn.buffers()) if t.is_floating_point())
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        attn.register_buffer(name, torch.tensor([value], dtype=ref.dtype, device=ref.device), persistent=False)


def install_kv_scales(model: nn.Module, kv_scales: dict[str, tuple[float, float]]) -> None:
    """Set the scales of every named attention module and switch the model to fp8-KV attention."""
    for name, (k, v) in kv_scales.items():
        set_kv_scale_buffers(model.get_submodule(name), k, v)
    use_fp8kv_attention(model)
