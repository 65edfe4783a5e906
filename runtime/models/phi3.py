"""Phi-3 (`phi3`: Phi-3 mini/small-shaped medium, Phi-3.5-mini, Phi-4-mini) over the paged KV
cache, as transformers/models/phi3/modeling_phi3.py computes it, under its parameter names.

The layer is Llama's (runtime/models/llama.py: RMSNorm, residual adds, SiLU-gated MLP) with the
projections fused on disk: `self_attn.qkv_proj` ([q; k; v] rows) and `mlp.gate_up_proj`
([gate; up] rows, the layout `silu_and_mul` takes), so runtime/models/fuse.py finds nothing to
fuse and a quantized artifact's QuantLinears are those two Linears. RoPE:

- LongRoPE (`rope_type` longrope, or its old names su / yarn that transformers' Phi3Config maps
  to it): inverse frequencies divided by `short_factor`, or by `long_factor` for sequences longer
  than `original_max_position_embeddings`, and cos/sin multiplied by the attention factor
  (sqrt(1 + ln(factor) / ln(original)) unless the config gives one). transformers picks the
  factors from the sequence's length at each forward (`longrope_frequency_update` in
  transformers/modeling_rope_utils.py) and, when a generated sequence crosses the original
  length, drops its cache and prefills it again with the long factors
  (`Phi3ForCausalLM.prepare_inputs_for_generation`), so every key of a sequence is rotated with
  one set. A paged cache shared by prefixes, filled chunk by chunk, cannot re-rotate a sequence
  whose future length it does not know, so the set is chosen once per served model: the long
  factors when the engine's max_model_len exceeds the original length
  (`set_max_model_len`, called by runtime/worker/model_runner.py), else the short ones. Within
  the original length with `--max-model-len` at most that, and for sequences longer than it
  otherwise, the logits are transformers'.
- partial_rotary_factor: only the first int(head_dim x factor) dims of each head rotate.
- sliding_window, when the config sets one, applies to every layer (the attention ops take it;
  on CUDA through the torch twin, `ops.twin_attention`, without CUDA graphs).
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
from slimserve.runtime.models.llama import (
    MLP,
    Attention,
    CausalLM,
    DecoderLayer,
    Fp32Buffers,
    ModelSpec,
    RMSNorm,
    StepTables,
    _rope_inv_freq,
)

PHI3_MODEL_TYPES = ("phi3",)


@dataclass(frozen=True)
class Phi3Spec(ModelSpec):
    """ModelSpec plus Phi-3's RoPE and window (`sliding_window` stays None: the window is
    attended, not a limit on the model's length); `inv_freq` holds the short factors' frequencies
    under LongRoPE."""

    rotary_dim: int = 0  # dims of each head that rotate (partial_rotary_factor); 0: head_dim
    long_inv_freq: tuple[float, ...] = ()  # LongRoPE's long factors' frequencies; empty: none
    rope_original_max: int = 0  # original_max_position_embeddings (LongRoPE's switch point)
    rope_attention_factor: float = 1.0  # cos and sin are multiplied by it (LongRoPE)
    attn_window: int | None = None  # every layer's sliding window; None: full attention


def _longrope(params: dict, config, dim: int) -> tuple[tuple, tuple, int, float]:
    """(short, long inverse frequencies, original length, attention factor) as transformers'
    `_compute_longrope_parameters` (transformers/modeling_rope_utils.py) computes them."""
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    orig = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    short, long = params.get("short_factor"), params.get("long_factor")
    if not orig or short is None or long is None or len(short) != dim // 2 or len(long) != dim // 2:
        raise ArtifactError(
            "config.json: longrope needs original_max_position_embeddings and short_factor / "
            f"long_factor lists of {dim // 2} values each"
        )
    factor = params.get("factor") or config.max_position_embeddings / orig
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    freqs = [1.0 / (torch.tensor(f, dtype=torch.float32) * theta**shape) for f in (short, long)]
    return tuple(freqs[0].tolist()), tuple(freqs[1].tolist()), int(orig), float(attention)


def phi3_spec(config) -> Phi3Spec:
    """Phi3Spec from a Phi3Config."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ArtifactError(f"config.json: hidden_act {act!r} is not supported for phi3: silu")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary = int(head_dim * (partial or 1.0))
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ArtifactError(
            f"config.json: partial_rotary_factor {partial} gives {rotary} rotary dims of "
            f"head_dim {head_dim}; it must give an even number from 2 to head_dim"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    long, orig, attention = (), 0, 1.0
    if kind in ("longrope", "su", "yarn"):
        inv, long, orig, attention = _longrope(params, config, rotary)
    else:
        inv = _rope_inv_freq(config, rotary)  # default / linear / llama3 over the rotary dims
    window = getattr(config, "sliding_window", None)
    if window is not None and not (isinstance(window, int) and window > 0):
        raise ArtifactError(f"config.json: sliding_window {window!r} must be a positive integer")
    return Phi3Spec(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=None,
        inv_freq=inv,
        rotary_dim=rotary,
        long_inv_freq=long,
        rope_original_max=orig,
        rope_attention_factor=attention,
        attn_window=window,
    )


class Phi3Attention(Attention):
    """Llama's attention with the checkpoint's fused `qkv_proj` and partial rotary dims."""

    def __init__(self, spec: Phi3Spec):
        Fp32Buffers.__init__(self)  # not Attention's: its q/k/v are three Linears
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.sizes = [h * d, kv * d, kv * d]
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)
        self.rotary_dim = spec.rotary_dim or d
        self.scale = d**-0.5
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(self, x, step: StepTables, batch: BatchInputs, kv_cache, kops: KernelOps):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        slots, ks, vs = batch.slot_mapping, self.k_scale, self.v_scale
        if self.rotary_dim == self.head_dim:
            kops.rope_and_write_kv(
                q, k, v, step.cos, step.sin, key_cache, value_cache, slots, ks, vs
            )
        else:  # the first rotary_dim dims rotate (rotate_half within them), the rest pass
            r = self.rotary_dim
            rope_inplace(q[..., :r], step.cos, step.sin)
            rope_inplace(k[..., :r], step.cos, step.sin)
            kops.write_kv_cache(k, v, key_cache, value_cache, slots, ks, vs)
        out = kops.attention(
            q, k, v, key_cache, value_cache, batch, step.attention, self.scale, ks, vs
        )
        return self.o_proj(out.reshape(t, -1))


class Phi3MLP(MLP):
    """down(silu(gate) * up) with [gate; up] one Linear on disk (`MLP.forward`'s fused path)."""

    def __init__(self, spec: Phi3Spec):
        nn.Module.__init__(self)  # not MLP's: its gate and up are two Linears
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)


class Phi3DecoderLayer(DecoderLayer):
    def __init__(self, spec: Phi3Spec, index: int = 0):
        nn.Module.__init__(self)  # DecoderLayer's forward over Phi-3's attention and MLP
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Phi3Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.ffn_name = "mlp"
        self.mlp = Phi3MLP(spec)


class Phi3Backbone(nn.Module):
    def __init__(self, spec: Phi3Spec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Phi3DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Phi3CausalLM(CausalLM):
    """CausalLM's forward over Phi-3 layers, with LongRoPE and the window in its step tables."""

    FP32_BUFFERS = ("inv_freq", "long_inv_freq")

    def __init__(self, spec: Phi3Spec):
        nn.Module.__init__(self)  # not CausalLM's: its layers are Llama's
        self.spec = spec
        self.model = Phi3Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, freqs in (("inv_freq", spec.inv_freq), ("long_inv_freq", spec.long_inv_freq)):
            self.register_buffer(
                name, torch.tensor(freqs or spec.inv_freq, dtype=torch.float32), persistent=False
            )
        # the twin plans a window on the host: not captured into a CUDA graph
        # (runtime/worker/model_runner.py `_use_cuda_graphs`)
        self.CUDA_GRAPHS = spec.attn_window is None
        self.long_rope = False
        self.set_max_model_len(spec.max_position_embeddings)
        self._kops = None

    def set_max_model_len(self, n: int) -> None:
        """LongRoPE: rotate with the long factors iff sequences may grow past the original
        length (the module docstring says why the choice is per model, not per sequence)."""
        self.long_rope = bool(self.spec.long_inv_freq) and n > self.spec.rope_original_max

    def reset_rope_buffers(self) -> None:
        """The long factors' frequencies after `to_empty` (runtime/models/load.py)."""
        spec = self.spec
        self.long_inv_freq.copy_(
            torch.tensor(spec.long_inv_freq or spec.inv_freq, dtype=torch.float32)
        )

    def kernel_ops(self, device: torch.device) -> KernelOps:
        cached = self._kops
        if cached is None or cached[0] != device:
            dtype = next((p.dtype for p in self.parameters() if p.dtype.is_floating_point), None)
            kops = ops.select(device, dtype)
            if self.spec.attn_window is not None:
                kops = ops.twin_attention(kops)
            cached = self._kops = (device, kops)
        return cached[1]

    def step_tables(self, batch: BatchInputs, kv_caches, kops: KernelOps) -> StepTables:
        spec = self.spec
        inv = self.long_inv_freq if self.long_rope else self.inv_freq
        cos, sin = rope_tables(batch.positions, inv)
        if spec.rope_attention_factor != 1.0:
            cos, sin = cos * spec.rope_attention_factor, sin * spec.rope_attention_factor
        plan = None
        if kv_caches:
            bs = kv_caches[0][0].shape[1]
            w = spec.attn_window
            plan = (
                kops.plan_attention(batch, bs) if w is None else kops.plan_attention(batch, bs, w)
            )
        return StepTables(cos, sin, plan)
