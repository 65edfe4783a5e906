"""Our Llama-family model (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE: runtime/models/moe.py) over a paged KV cache.

Module and parameter names equal transformers' (`model.layers.0.self_attn.q_proj...`), so
artifacts' safetensors load strictly into it and targeted Linears are swapped for QuantLinear by
the same rules as the compressed-tensors loader. The forward takes a flat, padding-free batch
(`BatchInputs`) and the per-layer KV caches explicitly; no global context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from slimserve.kernels.reference_attention import rope_tables
from slimserve.runtime.batch import BatchInputs
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers import ops
from slimserve.runtime.layers.ops import KernelOps
from slimserve.runtime.models.moe import MOE_MODEL_TYPES, MoeSpec, SparseMoeBlock, moe_spec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)


@dataclass(frozen=True)
class ModelSpec:
    """The numbers the runtime needs from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2, attention_bias)
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    tie_word_embeddings: bool
    sliding_window: int | None  # Mistral/Qwen2 window, None when off
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies [head_dim / 2]
    moe: MoeSpec | None = None  # mixture-of-experts routing and shapes; None: dense
    # q/k RMSNorm over the whole projection ([heads x head_dim], OLMoE) instead of per head
    qk_norm_full: bool = False
    clip_qkv: float | None = None  # q, k, v clamped to [-c, c] after the norms (OLMoE)


def _rope_inv_freq(config, head_dim: int) -> tuple[float, ...]:
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        inv = inv / params["factor"]
    elif kind == "llama3":  # Llama 3.1: smooth interpolation between low and high frequencies
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise ArtifactError(
            f"config.json: rope type {kind!r} is not supported by the runtime; "
            "supported: default, linear, llama3"
        )
    return tuple(inv.tolist())


def model_spec(config) -> ModelSpec:
    """ModelSpec from a transformers config; unsupported architectures are refused by name."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ArtifactError(
            f"config.json: model_type {mt!r} is not supported by the runtime; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    if mt in ("qwen2", "qwen2_moe", "qwen3_moe") and not getattr(
        config, "use_sliding_window", False
    ):
        window = None
    return ModelSpec(
        model_type=mt,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(getattr(config, "attention_bias", False)),
        o_bias=mt not in ("qwen2", "qwen2_moe") and bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe", "olmoe"),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=window,
        inv_freq=_rope_inv_freq(config, head_dim),
        moe=moe_spec(config, config.num_hidden_layers),
        qk_norm_full=mt == "olmoe",
        clip_qkv=getattr(config, "clip_qkv", None) if mt == "olmoe" else None,
    )


@dataclass(frozen=True)
class StepTables:
    """Built once per step and read by every decoder layer (`CausalLM.step_tables`)."""

    cos: torch.Tensor  # [T, D/2] fp32 RoPE tables (`rope_tables`)
    sin: torch.Tensor
    attention: object  # the backend's attention plan (`KernelOps.plan_attention`), or None


class Fp32Buffers(nn.Module):
    """A module whose buffers named in `FP32_BUFFERS` stay float32 through every dtype cast of
    the module (`.to(dtype)`, `.half()`, `.bfloat16()`, ...); device moves still apply.

    They are RoPE inverse frequencies and fp8 KV-cache scales: bookkeeping that the forward
    reads in fp32, not weights. Cast to bf16 (8 significant bits), an inverse frequency is off
    by up to 2^-9 relative, so the rotation angle at position t is off by up to
    t x 2^-9 x inv_freq: about a radian by position 1000 for the faster frequencies, and
    Llama-3.1's 128k context makes it worse. transformers keeps its `inv_freq` in fp32 too.
    """

    FP32_BUFFERS: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        before = {
            n: self._buffers[n] for n in self.FP32_BUFFERS if self._buffers.get(n) is not None
        }
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:  # fn cast it: redo its move from the fp32 original
                self._buffers[name] = (
                    torch.empty_like(new, dtype=torch.float32)
                    if old.is_meta
                    else old.to(new.device)
                )
        return self


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, kops: KernelOps | None = None
    ):
        kops = kops or ops.select(x.device, x.dtype)
        if residual is None:
            return kops.rms_norm(x, self.weight, self.eps)
        return kops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(Fp32Buffers):
    FP32_BUFFERS = ("k_scale", "v_scale")

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:  # per head (Qwen3), or over the whole projection (OLMoE)
            self.qk_norm_full = spec.qk_norm_full
            self.q_norm = RMSNorm(h * d if spec.qk_norm_full else d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(kv * d if spec.qk_norm_full else d, spec.rms_norm_eps)
        self.clip_qkv = spec.clip_qkv
        self.scale = d**-0.5
        # fp8 KV-cache scales (per layer, fp32 whatever the model dtype); 1.0 unless the artifact
        # carries calibrated ones
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(
        self,
        x,
        step: StepTables,
        batch: BatchInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        kops: KernelOps,
    ):
        t = x.shape[0]
        if hasattr(self, "qkv_proj"):  # fused at load (runtime/models/fuse.py)
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "q_norm") and self.qk_norm_full:
            q, k = self.q_norm(q, kops=kops), self.k_norm(k, kops=kops)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and not self.qk_norm_full:
            q, k = self.q_norm(q, kops=kops), self.k_norm(k, kops=kops)
        key_cache, value_cache = kv_cache
        # q and k rotated in place (they are views of this step's projection output), the
        # rotated k and v stored in the paged cache: one launch on the kernel path
        kops.rope_and_write_kv(
            q,
            k,
            v,
            step.cos,
            step.sin,
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
            step.attention,
            self.scale,
            self.k_scale,
            self.v_scale,
        )
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor, kops: KernelOps) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):  # fused at load: [T, 2I] is what silu_and_mul takes
            return self.down_proj(kops.silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(
            kops.silu_and_mul(torch.cat([self.gate_proj(x), self.up_proj(x)], -1))
        )


def ffn_name(spec: ModelSpec, index: int) -> str:
    """The decoder layer's feed-forward attribute: `mlp`, or Mixtral's `block_sparse_moe`."""
    moe = spec.moe
    return moe.block_name if moe is not None and moe.sparse_layers[index] else "mlp"


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # the checkpoint's name for the feed-forward block: a dense MLP or a SparseMoeBlock
        self.ffn_name = ffn_name(spec, index)
        if spec.moe is None or not spec.moe.sparse_layers[index]:
            self.mlp = MLP(spec)
        else:
            setattr(self, self.ffn_name, SparseMoeBlock(spec.hidden_size, spec.moe))

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(self, x, residual, step: StepTables, batch, kv_cache, kops: KernelOps):
        if residual is None:
            residual, x = x, self.input_layernorm(x, kops=kops)
        else:
            x, residual = self.input_layernorm(x, residual, kops)
        x = self.self_attn(x, step, batch, kv_cache, kops)
        x, residual = self.post_attention_layernorm(x, residual, kops)
        return self.ffn(x, kops), residual


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(Fp32Buffers):
    """Embedding -> decoder layers over the paged cache -> final norm -> lm_head (sampled rows).

    `inv_freq` (RoPE) and every layer's `k_scale`/`v_scale` stay fp32 in any model dtype
    (`Fp32Buffers`); RoPE angles and cos/sin are computed in fp32, once per step for all layers.
    The kernel backend (runtime/layers/ops.py) is resolved at the first forward on a device and
    kept, so no op reads the environment or imports a module on the hot path.
    """

    FP32_BUFFERS = ("inv_freq",)

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq", torch.tensor(spec.inv_freq, dtype=torch.float32), persistent=False
        )
        self._kops: tuple[torch.device, KernelOps] | None = None  # (device, its ops), first forward
        if spec.moe is not None:  # MoE blocks size their expert GEMMs on the host each step
            self.CUDA_GRAPHS = False

    def kernel_ops(self, device: torch.device) -> KernelOps:
        """The ops for `device` and the model's compute dtype, resolved from SLIMSERVE_KERNELS
        once and kept."""
        cached = self._kops
        if cached is None or cached[0] != device:
            dtype = next((p.dtype for p in self.parameters() if p.dtype.is_floating_point), None)
            cached = self._kops = (device, ops.select(device, dtype))
        return cached[1]

    def step_tables(
        self,
        batch: BatchInputs,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kops: KernelOps,
    ) -> StepTables:
        """What every layer of this step shares: RoPE cos/sin [T, D/2] fp32 and the attention
        plan (the torch path's index work; None on the kernel path)."""
        cos, sin = rope_tables(batch.positions, self.inv_freq)
        plan = kops.plan_attention(batch, kv_caches[0][0].shape[1]) if kv_caches else None
        return StepTables(cos, sin, plan)

    @torch.inference_mode()
    def forward(
        self, batch: BatchInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """fp32 logits [S, vocab] for the rows batch.logits_indices selects."""
        kops = self.kernel_ops(batch.input_ids.device)
        step = self.step_tables(batch, kv_caches, kops)
        x, residual = self.model.embed_tokens(batch.input_ids), None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, step, batch, kv, kops)
        x, _ = self.model.norm(x, residual, kops)
        return self.lm_head(x[batch.logits_indices]).float()
