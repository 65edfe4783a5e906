"""Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`, Gemma3ForCausalLM) over the paged KV
cache, computed as transformers/models/gemma2/modeling_gemma2.py and
transformers/models/gemma3/modeling_gemma3.py define them, under their parameter names:

- embeddings scaled by sqrt(hidden_size), that factor rounded to the model dtype first;
- RMSNorm as x * rsqrt(mean(x^2) + eps) * (1 + w), all in fp32, rounded once (`GemmaRMSNorm`);
- four norms per layer: input -> attention -> post_attention, added to the residual, then
  pre_feedforward -> GeGLU MLP (gelu, tanh approximation) -> post_feedforward, added;
- attention scaled by query_pre_attn_scalar^-0.5, its scores soft-capped (Gemma 2:
  attn_logit_softcapping), sliding-window layers and global ones as config.layer_types says;
- Gemma 3's per-head q/k norms (the same (1 + w) norm) and its sliding layers' own RoPE
  (rope_parameters["sliding_attention"], e.g. base 10k beside the global layers' 1M);
- the logits soft-capped at final_logit_softcapping.

The window and the cap are the attention ops' (runtime/layers/ops.py: the torch twin and the C
decode kernel take both). The Triton kernels take neither, so on CUDA these models attend through
the torch twin (`ops.twin_attention`) and run without CUDA graphs; the other ops stay Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from slimserve.kernels.reference_attention import rope_tables
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers.ops import KernelOps
from slimserve.runtime.models.llama import (
    MLP,
    Attention,
    CausalLM,
    DecoderLayer,
    ModelSpec,
    RMSNorm,
    _rope_inv_freq,
    shape_fields,
)

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# transformers' ACT2FN names of the GeGLU gate this module computes exactly
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class GemmaSpec(ModelSpec):
    """ModelSpec plus what Gemma 2/3 add; its per-layer windows (`layer_windows`), score and
    logit caps and query scale are ModelSpec's fields (`sliding_window` stays None: the windows
    are attended, not a limit on the model's length)."""

    local_inv_freq: tuple[float, ...] = ()  # the sliding layers' RoPE (Gemma 3); empty: shared
    hidden_act: str = "gelu_pytorch_tanh"


def _positive(config, name: str) -> float | None:
    v = getattr(config, name, None)
    if v is None:
        return None
    if not v > 0:
        raise ArtifactError(f"config.json: {name} {v!r} must be positive or null")
    return float(v)


def gemma_spec(config) -> GemmaSpec:
    """GemmaSpec from a Gemma2Config or Gemma3TextConfig."""
    mt = config.model_type
    if getattr(config, "use_bidirectional_attention", False):
        raise ArtifactError(
            f"config.json: {mt} with use_bidirectional_attention is an encoder, which the "
            "runtime does not serve; use a causal checkpoint"
        )
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ACTIVATIONS:
        raise ArtifactError(
            f"config.json: hidden_activation {act!r} is not supported for {mt}; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )
    head_dim = shape_fields(config)["head_dim"]
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ArtifactError(
            f"config.json: layer_types must list full_attention or sliding_attention for each of "
            f"the {n} layers, not {types}"
        )
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ArtifactError(
            f"config.json: sliding_window {window!r} must be a positive integer where "
            "layer_types has sliding_attention layers"
        )
    params = dict(getattr(config, "rope_parameters", None) or {})
    local: tuple[float, ...] = ()
    if "full_attention" in params or "sliding_attention" in params:  # Gemma 3: one per type
        full = params.get("full_attention") or {}
        inv = _rope_inv_freq(SimpleNamespace(rope_parameters=full), head_dim)
        local = _rope_inv_freq(
            SimpleNamespace(rope_parameters=params.get("sliding_attention") or full), head_dim
        )
    else:
        inv = _rope_inv_freq(config, head_dim)
    bias = bool(getattr(config, "attention_bias", False))
    return GemmaSpec(
        **shape_fields(config),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=mt == "gemma3_text",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        sliding_window=None,
        inv_freq=inv,
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attn_softcap=_positive(config, "attn_logit_softcapping"),
        final_softcap=_positive(config, "final_logit_softcapping"),
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        local_inv_freq=local,
        hidden_act=act,
    )


class GemmaRMSNorm(RMSNorm):
    """x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, rounded once to x's dtype (transformers'
    Gemma2RMSNorm: `(x * w).to(dtype)` where Llama rounds before the weight; the weight starts
    at 0, the identity). With `residual`, (norm(x + residual), x + residual) as RMSNorm."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor, residual=None, kops: KernelOps | None = None):
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(DecoderLayer):
    """Four norms: input -> attention -> post_attention, added to the residual stream, then
    pre_feedforward -> GeGLU MLP -> post_feedforward, added in the next layer's input norm
    (or the final one): the sums transformers' layer makes, in the same order of operands'
    values (addition is commutative in floating point)."""

    def __init__(self, spec: GemmaSpec, index: int):
        nn.Module.__init__(self)  # not DecoderLayer's: Gemma's norms and GeGLU MLP
        eps = spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.self_attn = Attention(spec, index, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.mlp = MLP(spec, act=ACTIVATIONS[spec.hidden_act])
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.ffn_name = "mlp"

    def forward(self, x, residual, step, batch, kv_cache, kops: KernelOps):
        h, residual = self.attend(x, residual, step, batch, kv_cache, kops)
        residual = residual + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(residual), kops)
        return self.post_feedforward_layernorm(h), residual


class GemmaCausalLM(CausalLM):
    """Embedding x sqrt(hidden) -> Gemma decoder layers -> final norm -> lm_head -> logit cap
    (CausalLM's `run`, its cap from the spec)."""

    FP32_BUFFERS = ("inv_freq", "local_inv_freq")
    LAYER = GemmaDecoderLayer
    NORM = GemmaRMSNorm
    HOST_ATTENTION = True  # the torch twin's attention, planned on the host (`ops.twin_attention`)
    CUDA_GRAPHS = False

    def rope_buffers(self) -> dict[str, tuple[float, ...]]:
        spec = self.spec
        return {"inv_freq": spec.inv_freq, "local_inv_freq": spec.local_inv_freq or spec.inv_freq}

    def rope(self, positions: torch.Tensor):
        glob = rope_tables(positions, self.inv_freq)
        local = rope_tables(positions, self.local_inv_freq) if self.spec.local_inv_freq else None
        return glob, local

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        # sqrt(hidden) as an fp32 scalar rounded to the model dtype, as transformers rounds it
        return x * torch.tensor(math.sqrt(self.spec.hidden_size)).to(x.dtype)
