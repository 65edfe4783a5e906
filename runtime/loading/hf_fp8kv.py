"""FP8 KV cache inside a transformers model: the attention plug-in `slimserve_fp8kv`.

Registered with transformers' `AttentionInterface`, it fake-quantizes `key_states` /
`value_states` with the attention module's `k_scale` / `v_scale` buffers and then runs the sdpa
implementation, so perplexity measured in the compression pipeline and after `load_model` (HF
path) both see fp8 KV. `install_kv_scales` sets those buffers and selects that implementation.
`observing_attention` lets the calibrating stage see each call's query, K (after RoPE) and V.
A module given `set_kv_int_bits` instead reads K/V back from an int8 / int4 cache (per token and
KV head, kernels/kv_quant.py), as the serving engine stores them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from slimserve.kernels import kv_quant
from slimserve.runtime.artifact.kv_scales import fp8_e4m3_roundtrip
from slimserve.runtime.artifact.weights import decoder_layer_index

KV_ATTENTION = "slimserve_fp8kv"  # name registered with transformers' AttentionInterface
_OBSERVER = "_slimserve_kv_observer"  # instance attribute `observing_attention` sets
_INT_BITS = "_slimserve_kv_bits"  # instance attribute `set_kv_int_bits` sets (8 or 4)
AttentionObserver = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", dict], None
]


def fp8kv_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
):
    """sdpa attention on fp8-round-tripped K and V ([batch, kv_heads, seq, head_dim]).

    A module without `k_scale`/`v_scale` buffers (a layer not calibrated yet) gets plain sdpa.
    An observer set by `observing_attention` sees the call first, before any fp8 round trip.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observer = module.__dict__.get(_OBSERVER)
    if observer is not None:
        observer(query, key, value, attention_mask, kwargs)
    k_scale, v_scale = getattr(module, "k_scale", None), getattr(module, "v_scale", None)
    bits = module.__dict__.get(_INT_BITS)
    if bits:
        key, value = (kv_int_roundtrip(t, bits) for t in (key, value))
    elif k_scale is not None and v_scale is not None:
        key, value = fp8_e4m3_roundtrip(key, k_scale), fp8_e4m3_roundtrip(value, v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def kv_int_roundtrip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """What an int8 / int4 cache gives back for x [..., head_dim] (rows per token and head), in
    x's dtype."""
    d = x.shape[-1]
    return kv_quant.dequantize_rows(kv_quant.quantize_rows(x, bits), d, bits).to(x.dtype)


def set_kv_int_bits(attn: nn.Module, bits: int) -> None:
    """Make `attn` attend over K/V read back from an int cache of `bits` (8, 4; 0: exact)."""
    attn.__dict__[_INT_BITS] = bits


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


@contextmanager
def observing_attention(attn: nn.Module, observer: AttentionObserver) -> Iterator[None]:
    """While inside, every `slimserve_fp8kv` call of `attn` first calls
    observer(query, key, value, attention_mask, kwargs): query [b, heads, s, d], key (after RoPE,
    and k_norm where the model has one) and value [b, kv_heads, s, d], not yet fp8-round-tripped;
    `sdpa_attention_forward(attn, query, key, value, attention_mask, **kwargs)` redoes the call.
    The model must attend through `slimserve_fp8kv` (`use_fp8kv_attention`)."""
    if attn.__dict__.get(_OBSERVER) is not None:
        raise RuntimeError("this attention module is already observed")
    attn.__dict__[_OBSERVER] = observer
    try:
        yield
    finally:
        del attn.__dict__[_OBSERVER]


def set_kv_scale_buffers(attn: nn.Module, k_scale: float, v_scale: float) -> None:
    """Give an attention module its `k_scale`/`v_scale` buffers ([1], the module's dtype).

    Non-persistent: the exporter writes them from `CompressionState.kv_scales`, not the state dict.
    """
    # Model dtype and device, from a float parameter or (QuantLinear holds buffers) buffer.
    ref = next(t for t in (*attn.parameters(), *attn.buffers()) if t.is_floating_point())
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        attn.register_buffer(
            name, torch.tensor([value], dtype=ref.dtype, device=ref.device), persistent=False
        )


def install_kv_scales(
    model: nn.Module, kv_scales: dict[str, tuple[float, float]], skip_layers: Iterable[int] = ()
) -> None:
    """Set the scales of every named attention module and switch the model to fp8-KV attention;
    the attention of decoder layers in `skip_layers` gets no scales and attends over exact K/V."""
    skip = set(skip_layers)
    for name, (k, v) in kv_scales.items():
        if decoder_layer_index(name) not in skip:
            set_kv_scale_buffers(model.get_submodule(name), k, v)
    use_fp8kv_attention(model)


def clear_kv_scale_buffers(attn: nn.Module) -> None:
    """Drop an attention module's k/v scales: it attends over exact K/V again."""
    for name in ("k_scale", "v_scale"):
        attn._buffers.pop(name, None)
