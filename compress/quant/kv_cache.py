"""FP8 KV-cache scales: calibrate one static per-tensor scale for K and for V in every layer.

The KV cache stores `k_fp8 = k / k_scale` in float8_e4m3fn, where K is the key *as cached*:
after Qwen3's `k_norm` and after RoPE (formats.md §1.6). `scale = absmax / 448` puts the largest
calibration value at the top of e4m3's range.

Pure part: `fp8_e4m3_roundtrip`, `kv_scale_from_absmax`. Model plumbing: the attention function
`slimserve_fp8kv` (registered with transformers' `AttentionInterface`) fake-quantizes
`key_states`/`value_states` with the attention module's `k_scale`/`v_scale` buffers and then runs
the sdpa implementation, so perplexity measured in the pipeline and after `load_model` both see
fp8 KV. `install_kv_scales` sets those buffers and selects that attention implementation.
"""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel, ConfigDict, field_validator
from torch import nn

from slimserve.compress.stage import CompressionState, StageReport

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
# Floor of a scale: the smallest normal float16, so a scale stored in any model dtype is > 0.
_MIN_SCALE = torch.finfo(torch.float16).tiny
KV_ATTENTION = "slimserve_fp8kv"  # name registered with transformers' AttentionInterface
SUPPORTED_KV_DTYPES = ("fp8_e4m3",)


def fp8_e4m3_roundtrip(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """What reading back `x` from an fp8 e4m3 cache with `scale` gives, in x's dtype.

    x / scale is computed in float32, saturated to ±448 (e4m3fn has no infinity), rounded to
    nearest-even by torch's cast, and multiplied back by the scale.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def kv_scale_from_absmax(absmax: float) -> float:
    """Static per-tensor fp8 scale: absmax maps to 448; an all-zero tensor still gets a positive scale."""
    return max(absmax, _MIN_SCALE * FP8_E4M3_MAX) / FP8_E4M3_MAX


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


class KvCacheOptions(BaseModel):
    """Options of the `kv_cache` stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str = "fp8_e4m3"  # KV-cache storage dtype; only fp8_e4m3 (float8_e4m3fn) for now

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        if v not in SUPPORTED_KV_DTYPES:
            raise ValueError(f"dtype {v!r} is not supported; supported: {', '.join(SUPPORTED_KV_DTYPES)}")
        return v


class KvCacheStage:
    """Calibrate per-layer static fp8 K/V scales and make the model attend over fp8 K/V."""

    name = "kv_cache"
    needs_calibration = True
    layerwise = True

    def __init__(self, options: KvCacheOptions):
        self.options = options
        self.report = StageReport(self.name, details={"dtype": options.dtype, "layers": {}})

    def prepare(self, state: CompressionState) -> None:
        # Layers without scales yet attend as sdpa; each gets its scales in compress_layer, so the
        # next layer is calibrated on the outputs of an fp8-KV layer.
        use_fp8kv_attention(state.model)

    def apply(self, state: CompressionState) -> None:
        from slimserve.compress.calibration import run_layerwise

        run_layerwise(state, self)

    def compress_layer(self, ctx) -> None:
        t0 = time.perf_counter()
        attn = ctx.module(ctx.mapping.attention)
        k_absmax, v_absmax = observe_kv_absmax(ctx, attn)
        storage = ctx.state.storage_dtype
        k_scale, v_scale = (_round_to(kv_scale_from_absmax(a), storage) for a in (k_absmax, v_absmax))
        set_kv_scale_buffers(attn, k_scale, v_scale)
        name = f"{ctx.prefix}.{ctx.mapping.attention}"
        ctx.state.kv_scales[name] = (k_scale, v_scale)
        self.report.details["layers"][name] = {
            "k_absmax": k_absmax, "v_absmax": v_absmax, "k_scale": k_scale, "v_scale": v_scale}
        self.report.seconds += time.perf_counter() - t0

    def finalize(self, state: CompressionState) -> StageReport:
        return self.report


def observe_kv_absmax(ctx, attn: nn.Module) -> tuple[float, float]:
    """Absmax over all calibration tokens of the cached K (after k_norm and RoPE) and of V.

    Hooks: a pre-hook on the attention module takes the (cos, sin) it receives; K is read at the
    output of `k_norm` when the module has one (Qwen3), else of k_proj, then rotated; V is v_proj's
    output.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim = attn.head_dim
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    absmax = {"k": 0.0, "v": 0.0}

    def take_rope(_module, _args, kwargs):
        rope["cos_sin"] = kwargs["position_embeddings"]

    def on_key(_module, _inputs, out):
        b, s = out.shape[:2]
        k = out.reshape(b, s, -1, head_dim).transpose(1, 2)  # [b, kv_heads, s, head_dim]
        cos, sin = rope["cos_sin"]
        k = apply_rotary_pos_emb(k, k, cos, sin)[1]
        absmax["k"] = max(absmax["k"], k.abs().max().item())

    def on_value(_module, _inputs, out):
        absmax["v"] = max(absmax["v"], out.abs().max().item())

    key_source = getattr(attn, "k_norm", None)
    if key_source is None:
        key_source = ctx.module(ctx.mapping.k_proj)
    handles = [
        attn.register_forward_pre_hook(take_rope, with_kwargs=True),
        key_source.register_forward_hook(on_key),
        ctx.module(ctx.mapping.v_proj).register_forward_hook(on_value),
    ]
    try:
        ctx.forward()
    finally:
        for h in handles:
            h.remove()
    return absmax["k"], absmax["v"]


def _round_to(x: float, dtype: torch.dtype) -> float:
    """x rounded to nearest in `dtype` (the value the artifact stores)."""
    return torch.tensor(x, dtype=dtype).item()
