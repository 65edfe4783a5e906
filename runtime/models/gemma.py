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
from slimserve.runtime.batch import BatchInputs
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers import ops
from slimserve.runtime.layers.ops import KernelOps
from slimserve.runtime.models.llama import CausalLM, Fp32Buffers, ModelSpec, _rope_inv_freq

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# transformers' ACT2FN names of the GeGLU gate this module computes exactly
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class GemmaSpec(ModelSpec):
    """ModelSpec plus what Gemma 2/3 add (`sliding_window` stays None: the windows are per layer
    and attended, not a limit on the model's length)."""

    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None: global
    attn_softcap: float | None = None  # scores capped to c * tanh(s / c) (Gemma 2)
    final_softcap: float | None = None  # logits capped the same way
    attn_scale: float = 1.0  # query_pre_attn_scalar ** -0.5
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
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
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
        model_type=mt,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
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


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, rounded once to x's dtype (transformers'
    Gemma2RMSNorm: `(x * w).to(dtype)` where Llama rounds before the weight)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


@dataclass(frozen=True)
class GemmaStep:
    """What the layers of one step share: RoPE tables per layer kind, attention plans per
    window (`GemmaCausalLM.step_tables`)."""

    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # sliding? -> (cos, sin) [T, D/2] fp32
    plans: dict[int | None, object]  # window (None: global) -> the backend's attention plan


class GemmaAttention(Fp32Buffers):
    FP32_BUFFERS = ("k_scale", "v_scale")

    def __init__(self, spec: GemmaSpec, index: int):
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:  # Gemma 3: per head, before RoPE
            self.q_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(d, spec.rms_norm_eps)
        self.window = spec.layer_windows[index]
        self.softcap = spec.attn_softcap
        self.scale = spec.attn_scale
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(self, x, step: GemmaStep, batch: BatchInputs, kv_cache, kops: KernelOps):
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):  # fused at load (runtime/models/fuse.py)
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = step.rope[self.window is not None]
        key_cache, value_cache = kv_cache
        kops.rope_and_write_kv(
            q,
            k,
            v,
            cos,
            sin,
            key_cache,
            value_cache,
            batch.slot_mapping,
            self.k_scale,
            self.v_scale,
        )
        out = kops.attention(
            q,
            k,
            v,
            key_cache,
            value_cache,
            batch,
            step.plans[self.window],
            self.scale,
            self.k_scale,
            self.v_scale,
            softcap=self.softcap,
        )
        return self.o_proj(out.reshape(t, -1))


class GemmaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), in the model dtype as transformers computes it."""

    def __init__(self, spec: GemmaSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor, kops: KernelOps) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):  # fused at load (runtime/models/fuse.py)
            gate, up = self.gate_up_proj(x).split(self.gate_up_proj.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: GemmaSpec, index: int):
        super().__init__()
        eps = spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.self_attn = GemmaAttention(spec, index)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.mlp = GemmaMLP(spec)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.ffn_name = "mlp"

    @property
    def ffn(self) -> nn.Module:
        return self.mlp

    def forward(self, x, step: GemmaStep, batch, kv_cache, kops: KernelOps):
        h = self.self_attn(self.input_layernorm(x), step, batch, kv_cache, kops)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), kops)
        return x + self.post_feedforward_layernorm(h)


class GemmaBackbone(nn.Module):
    def __init__(self, spec: GemmaSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)


class GemmaCausalLM(CausalLM):
    """Embedding x sqrt(hidden) -> Gemma decoder layers -> final norm -> lm_head -> logit cap.

    A CausalLM (the loader, runner and fusion read the same attributes: `spec`, `model.layers`,
    `lm_head`, `inv_freq`, `kernel_ops`) with its own layers, step tables and forward.
    """

    FP32_BUFFERS = ("inv_freq", "local_inv_freq")
    CUDA_GRAPHS = False  # the torch twin's attention plans on the host (`ops.twin_attention`)

    def __init__(self, spec: GemmaSpec):
        nn.Module.__init__(self)  # not CausalLM's: its layers are Llama's
        self.spec = spec
        self.model = GemmaBackbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq", torch.tensor(spec.inv_freq, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "local_inv_freq",
            torch.tensor(spec.local_inv_freq or spec.inv_freq, dtype=torch.float32),
            persistent=False,
        )
        self._kops = None

    def reset_rope_buffers(self) -> None:
        """The sliding layers' frequencies after `to_empty` (runtime/models/load.py)."""
        spec = self.spec
        self.local_inv_freq.copy_(
            torch.tensor(spec.local_inv_freq or spec.inv_freq, dtype=torch.float32)
        )

    def kernel_ops(self, device: torch.device) -> KernelOps:
        cached = self._kops
        if cached is None or cached[0] != device:
            dtype = next((p.dtype for p in self.parameters() if p.dtype.is_floating_point), None)
            cached = self._kops = (device, ops.twin_attention(ops.select(device, dtype)))
        return cached[1]

    def step_tables(self, batch: BatchInputs, kv_caches, kops: KernelOps) -> GemmaStep:
        glob = rope_tables(batch.positions, self.inv_freq)
        local = (
            rope_tables(batch.positions, self.local_inv_freq) if self.spec.local_inv_freq else glob
        )
        plans = {}
        if kv_caches:
            bs = kv_caches[0][0].shape[1]
            for w in set(self.spec.layer_windows):
                plans[w] = (
                    kops.plan_attention(batch, bs)
                    if w is None
                    else kops.plan_attention(batch, bs, w)
                )
        return GemmaStep({False: glob, True: local}, plans)

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, kv_caches) -> torch.Tensor:
        """fp32 logits [S, vocab] for the rows batch.logits_indices selects."""
        kops = self.kernel_ops(batch.input_ids.device)
        step = self.step_tables(batch, kv_caches, kops)
        x = self.model.embed_tokens(batch.input_ids)
        # sqrt(hidden) as an fp32 scalar rounded to the model dtype, as transformers rounds it
        x = x * torch.tensor(math.sqrt(self.spec.hidden_size)).to(x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, step, batch, kv, kops)
        logits = self.lm_head(self.model.norm(x[batch.logits_indices])).float()
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
