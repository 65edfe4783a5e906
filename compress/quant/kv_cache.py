"""The `kv_cache` stage: calibrate one static fp8 scale for K and for V in every attention layer.

The scale arithmetic is the artifact's (runtime/artifact/kv_scales.py); the model attends over
fp8-round-tripped K/V through the runtime's transformers plug-in (runtime/hf_fp8kv.py), so each
layer is calibrated on the outputs of the fp8-KV layers before it.
"""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel, ConfigDict, field_validator
from torch import nn

from slimserve.compress.stage import CompressionState, Stage, StageReport
from slimserve.runtime.artifact.kv_scales import SUPPORTED_KV_DTYPES, kv_scale_from_absmax
from slimserve.runtime.hf_fp8kv import set_kv_scale_buffers, use_fp8kv_attention


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


class KvCacheStage(Stage):
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
