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

from slimserve.kernels.reference_attention import rope_tables
from slimserve.runtime.errors import ArtifactError
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

PHI3_MODEL_TYPES = ("phi3",)


@dataclass(frozen=True)
class Phi3Spec(ModelSpec):
    """ModelSpec plus Phi-3's RoPE; its partial rotary dims (`rotary_dim`) and window (every
    layer's, in `layer_windows`) are ModelSpec's fields (`sliding_window` stays None: the window
    is attended, not a limit on the model's length); `inv_freq` holds the short factors'
    frequencies under LongRoPE."""

    long_inv_freq: tuple[float, ...] = ()  # LongRoPE's long factors' frequencies; empty: none
    rope_original_max: int = 0  # original_max_position_embeddings (LongRoPE's switch point)
    rope_attention_factor: float = 1.0  # cos and sin are multiplied by it (LongRoPE)


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
    shape = shape_fields(config)
    head_dim = shape["head_dim"]
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
        **shape,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=None,
        inv_freq=inv,
        layer_windows=() if window is None else (window,) * config.num_hidden_layers,
        rotary_dim=rotary,
        long_inv_freq=long,
        rope_original_max=orig,
        rope_attention_factor=attention,
    )


class Phi3DecoderLayer(DecoderLayer):
    """Llama's layer over the checkpoint's fused `qkv_proj` and `gate_up_proj`."""

    def __init__(self, spec: Phi3Spec, index: int = 0):
        nn.Module.__init__(self)  # not DecoderLayer's: its q/k/v and gate/up are fused on disk
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, index, fused_qkv=True)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.ffn_name = "mlp"
        self.mlp = MLP(spec, fused=True)


class Phi3CausalLM(CausalLM):
    """CausalLM over Phi-3 layers, with LongRoPE in its RoPE tables."""

    FP32_BUFFERS = ("inv_freq", "long_inv_freq")
    LAYER = Phi3DecoderLayer

    def __init__(self, spec: Phi3Spec):
        super().__init__(spec)
        self.long_rope = False
        self.set_max_model_len(spec.max_position_embeddings)

    def set_max_model_len(self, n: int) -> None:
        """LongRoPE: rotate with the long factors iff sequences may grow past the original
        length (the module docstring says why the choice is per model, not per sequence)."""
        self.long_rope = bool(self.spec.long_inv_freq) and n > self.spec.rope_original_max

    def rope_buffers(self) -> dict[str, tuple[float, ...]]:
        spec = self.spec
        return {"inv_freq": spec.inv_freq, "long_inv_freq": spec.long_inv_freq or spec.inv_freq}

    def rope(self, positions: torch.Tensor):
        cos, sin = rope_tables(positions, self.long_inv_freq if self.long_rope else self.inv_freq)
        f = self.spec.rope_attention_factor
        if f != 1.0:
            cos, sin = cos * f, sin * f
        return (cos, sin), None
