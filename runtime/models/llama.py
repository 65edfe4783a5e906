"""Our Llama-family model (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE: runtime/models/moe.py) over a paged KV cache.

Module and parameter names equal transformers' (`model.layers.0.self_attn.q_proj...`), so
artifacts' safetensors load strictly into it and targeted Linears are swapped for QuantLinear by
the same rules as the compressed-tensors loader. The forward takes a flat, padding-free batch
(`BatchInputs`) and the per-layer KV caches explicitly; no global context.

Its Attention, MLP, DecoderLayer and CausalLM serve Gemma 2 / 3 and Phi-3 too
(runtime/models/gemma.py, phi3.py): the spec carries their per-layer windows, soft caps, query
scale and partial rotary dims, and the layers take Gemma's norm and GeGLU gate or Phi-3's fused
projections as arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from slimserve.kernels.reference_attention import rope_inplace, rope_tables
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
    # what Gemma and Phi-3 vary in the shared layers (runtime/models/gemma.py, phi3.py); the
    # defaults are Llama's
    layer_windows: tuple[int | None, ...] = ()  # per layer: the window it attends (None: all)
    attn_softcap: float | None = None  # attention scores capped to c * tanh(s / c)
    final_softcap: float | None = None  # logits capped the same way
    attn_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
    rotary_dim: int = 0  # dims of each head that rotate (partial rotary); 0: head_dim


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


def shape_fields(config) -> dict:
    """The ModelSpec fields every architecture reads from its config the same way: the model
    type, widths, layer and head counts, norm epsilon and length (Gemma's and Phi-3's specs
    too, runtime/models/gemma.py and phi3.py)."""
    heads = config.num_attention_heads
    return dict(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
    )


def model_spec(config) -> ModelSpec:
    """ModelSpec from a transformers config; unsupported architectures are refused by name."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ArtifactError(
            f"config.json: model_type {mt!r} is not supported by the runtime; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    shape = shape_fields(config)
    window = getattr(config, "sliding_window", None)
    if mt in ("qwen2", "qwen2_moe", "qwen3_moe") and not getattr(
        config, "use_sliding_window", False
    ):
        window = None
    return ModelSpec(
        **shape,
        qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(getattr(config, "attention_bias", False)),
        o_bias=mt not in ("qwen2", "qwen2_moe") and bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe", "olmoe"),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=window,
        inv_freq=_rope_inv_freq(config, shape["head_dim"]),
        moe=moe_spec(config, config.num_hidden_layers),
        qk_norm_full=mt == "olmoe",
        clip_qkv=getattr(config, "clip_qkv", None) if mt == "olmoe" else None,
    )


@dataclass(frozen=True)
class StepTables:
    """Built once per step and read by every decoder layer (`CausalLM.step_tables`)."""

    cos: torch.Tensor  # [T, D/2] fp32 RoPE tables (`rope_tables`)
    sin: torch.Tensor
    # window (None: full attention) -> the backend's attention plan (`KernelOps.plan_attention`,
    # None on the kernel path), one per window the model's layers attend; empty without caches
    plans: dict
    local: tuple[torch.Tensor, torch.Tensor] | None = None  # the sliding layers' own (cos, sin)

    def rope(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of a layer attending `window`: the sliding layers' own where the model
        has them (Gemma 3), else the shared tables."""
        if window is not None and self.local is not None:
            return self.local
        return self.cos, self.sin


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
    """Self-attention over the paged cache, for every architecture the runtime serves.

    q/k/v are three Linears, or one `qkv_proj` ([q; k; v] rows: Phi-3 on disk, the others once
    runtime/models/fuse.py fused them). The q/k norms (`norm`: Llama's RMSNorm or Gemma's
    (1 + w) one) are per head (Qwen3, Gemma 3) or over the whole projection (OLMoE; with heads
    split over ranks, `full_norm` gathers their sums of squares: runtime/distributed/layers.py).
    The spec's per-layer window, score soft cap and scale, and partial rotary dims are Gemma's
    and Phi-3's (their defaults Llama's).
    """

    FP32_BUFFERS = ("k_scale", "v_scale")

    def __init__(self, spec: ModelSpec, index: int = 0, norm=RMSNorm, fused_qkv: bool = False):
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.qkv_sizes = [h * d, kv * d, kv * d]  # a fused qkv_proj's outputs, split
        if fused_qkv:
            self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.qkv_sizes), bias=spec.qkv_bias)
        else:
            self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.qkv_bias)
            self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.qkv_bias)
            self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=spec.o_bias)
        self.qk_norm_full = spec.qk_norm_full
        # a tensor-parallel rank's norm of its part of the whole projection (OLMoE): set by
        # runtime/distributed/layers.py `parallelize`; None: this rank holds all of it
        self.full_norm = None
        if spec.qk_norm:  # per head (Qwen3, Gemma 3), or over the whole projection (OLMoE)
            self.q_norm = norm(h * d if spec.qk_norm_full else d, spec.rms_norm_eps)
            self.k_norm = norm(kv * d if spec.qk_norm_full else d, spec.rms_norm_eps)
        self.clip_qkv = spec.clip_qkv
        self.window = spec.layer_windows[index] if spec.layer_windows else None
        self.softcap = spec.attn_softcap
        self.scale = d**-0.5 if spec.attn_scale is None else spec.attn_scale
        self.rotary_dim = spec.rotary_dim or d
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
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_full:
            if self.full_norm is None:
                q, k = self.q_norm(q, kops=kops), self.k_norm(k, kops=kops)
            else:
                q, k = self.full_norm(q, k, self.q_norm, self.k_norm)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm") and not self.qk_norm_full:
            q, k = self.q_norm(q, kops=kops), self.k_norm(k, kops=kops)
        cos, sin = step.rope(self.window)
        key_cache, value_cache = kv_cache
        slots, ks, vs = batch.slot_mapping, self.k_scale, self.v_scale
        if self.rotary_dim == self.head_dim:
            # q and k rotated in place (they are views of this step's projection output), the
            # rotated k and v stored in the paged cache: one launch on the kernel path
            kops.rope_and_write_kv(q, k, v, cos, sin, key_cache, value_cache, slots, ks, vs)
        else:  # the first rotary_dim dims rotate (rotate_half within them), the rest pass
            r = self.rotary_dim
            rope_inplace(q[..., :r], cos, sin)
            rope_inplace(k[..., :r], cos, sin)
            kops.write_kv_cache(k, v, key_cache, value_cache, slots, ks, vs)
        plan = step.plans.get(self.window)
        out = kops.attention(
            q, k, v, key_cache, value_cache, batch, plan, self.scale, ks, vs, softcap=self.softcap
        )
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SiLU through `silu_and_mul`, or another gate activation
    (`act`, Gemma's GeGLU). gate and up are two Linears, or one `gate_up_proj` ([gate; up]
    rows: Phi-3 on disk, the others once runtime/models/fuse.py fused them)."""

    def __init__(self, spec: ModelSpec, act=None, fused: bool = False):
        super().__init__()
        hidden, inter, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        if fused:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act  # None: SiLU

    def forward(self, x: torch.Tensor, kops: KernelOps) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):  # [T, 2I] is what silu_and_mul takes
            h = self.gate_up_proj(x)
        else:
            h = torch.cat([self.gate_proj(x), self.up_proj(x)], -1)
        if self.act is None:
            return self.down_proj(kops.silu_and_mul(h))
        gate, up = h.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def ffn_name(spec: ModelSpec, index: int) -> str:
    """The decoder layer's feed-forward attribute: `mlp`, or Mixtral's `block_sparse_moe`."""
    moe = spec.moe
    return moe.block_name if moe is not None and moe.sparse_layers[index] else "mlp"


class DecoderLayer(nn.Module):
    """input norm -> attention -> (residual add) post-attention norm -> feed-forward.

    Layers take and return (hidden, residual): the residual stream is added into the next norm
    (`fused_add_rms_norm`), so a pipeline stage hands both on (runtime/distributed/pipeline.py).
    """

    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, index)
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

    def attend(self, x, residual, step: StepTables, batch, kv_cache, kops: KernelOps):
        """(attention output, residual stream including this layer's input)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x, kops=kops)
        else:
            x, residual = self.input_layernorm(x, residual, kops)
        return self.self_attn(x, step, batch, kv_cache, kops), residual

    def forward(self, x, residual, step: StepTables, batch, kv_cache, kops: KernelOps):
        x, residual = self.attend(x, residual, step, batch, kv_cache, kops)
        x, residual = self.post_attention_layernorm(x, residual, kops)
        return self.ffn(x, kops), residual


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, layer=DecoderLayer, norm=RMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layer(spec, i) for i in range(spec.num_layers))
        self.norm = norm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(Fp32Buffers):
    """Embedding -> decoder layers over the paged cache -> final norm -> lm_head (sampled rows).

    `inv_freq` (RoPE) and every layer's `k_scale`/`v_scale` stay fp32 in any model dtype
    (`Fp32Buffers`); RoPE angles and cos/sin are computed in fp32, once per step for all layers.
    The kernel backend (runtime/layers/ops.py) is resolved at the first forward on a device and
    kept, so no op reads the environment or imports a module on the hot path.

    Gemma and Phi-3 (runtime/models/gemma.py, phi3.py) are subclasses: their own layers
    (`LAYER`, `NORM`), extra RoPE frequencies (`rope_buffers`, `rope`), embedding scale
    (`embed`); a model whose layers attend windows or cap scores (`host_attention`) attends
    through the torch twin on CUDA (`ops.twin_attention`) and runs without CUDA graphs.
    """

    FP32_BUFFERS = ("inv_freq",)
    LAYER = DecoderLayer
    NORM = RMSNorm
    HOST_ATTENTION = False  # attend through the twin whatever the spec says (Gemma)

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec, self.LAYER, self.NORM)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, freqs in self.rope_buffers().items():
            self.register_buffer(name, torch.tensor(freqs, dtype=torch.float32), persistent=False)
        # the windows this model's layers attend, one attention plan each per step
        self.windows = tuple(dict.fromkeys(spec.layer_windows or (None,)))
        self.host_attention = (
            self.HOST_ATTENTION
            or any(w is not None for w in self.windows)
            or spec.attn_softcap is not None
        )
        self._kops: tuple[torch.device, KernelOps] | None = None  # (device, its ops), first forward
        # MoE blocks size their expert GEMMs on the host each step; the twin plans on the host
        # (runtime/worker/model_runner.py `_use_cuda_graphs`)
        if spec.moe is not None or self.host_attention:
            self.CUDA_GRAPHS = False

    def rope_buffers(self) -> dict[str, tuple[float, ...]]:
        """The RoPE frequency buffers (name -> values), all in FP32_BUFFERS."""
        return {"inv_freq": self.spec.inv_freq}

    def reset_rope_buffers(self) -> None:
        """The frequencies after `to_empty` (runtime/models/load.py)."""
        for name, freqs in self.rope_buffers().items():
            getattr(self, name).copy_(torch.tensor(freqs, dtype=torch.float32))

    def kernel_ops(self, device: torch.device) -> KernelOps:
        """The ops for `device` and the model's compute dtype, resolved from SLIMSERVE_KERNELS
        once and kept."""
        cached = self._kops
        if cached is None or cached[0] != device:
            dtype = next((p.dtype for p in self.parameters() if p.dtype.is_floating_point), None)
            kops = ops.select(device, dtype)
            if self.host_attention:
                kops = ops.twin_attention(kops)
            cached = self._kops = (device, kops)
        return cached[1]

    def rope(self, positions: torch.Tensor):
        """((cos, sin) of the layers, the sliding layers' own (cos, sin) or None)."""
        return rope_tables(positions, self.inv_freq), None

    def step_tables(
        self,
        batch: BatchInputs,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kops: KernelOps,
    ) -> StepTables:
        """What every layer of this step shares: RoPE cos/sin [T, D/2] fp32 and the attention
        plan of each window (the torch path's index work; None on the kernel path)."""
        (cos, sin), local = self.rope(batch.positions)
        plans = {}
        if kv_caches:
            bs = kv_caches[0][0].shape[1]
            for w in self.windows:
                plans[w] = (
                    kops.plan_attention(batch, bs)
                    if w is None
                    else kops.plan_attention(batch, bs, w)
                )
        return StepTables(cos, sin, plans, local)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def run(self, batch: BatchInputs, kv_caches, x=None, residual=None):
        """This model's (or pipeline stage's, runtime/distributed/pipeline.py) layers over
        `batch`: from the embedding where it holds one, else from (x, residual); the sampled
        rows' fp32 logits where it holds lm_head, else (hidden, residual)."""
        kops = self.kernel_ops(batch.input_ids.device)
        step = self.step_tables(batch, kv_caches, kops)
        if self.model.embed_tokens is not None:
            x, residual = self.embed(batch.input_ids), None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, step, batch, kv, kops)
        if self.lm_head is None:
            return x, residual
        x, _ = self.model.norm(x, residual, kops)
        logits = self.lm_head(x[batch.logits_indices]).float()
        cap = self.spec.final_softcap  # after the vocabulary-parallel gather, on the full row
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def forward(
        self, batch: BatchInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """fp32 logits [S, vocab] for the rows batch.logits_indices selects."""
        return self.run(batch, kv_caches)
