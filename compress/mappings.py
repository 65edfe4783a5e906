"""Per-architecture layer mappings: where the decoder layers are, which norm feeds which Linears.

Stages never branch on class names (docs/architecture.md, "A new architecture"): they look the
model's `config.model_type` up here. An architecture missing from `ARCHITECTURES` is refused
with the list of supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from slimserve.compress.errors import UnsupportedModelError
from slimserve.runtime.loading.moe_experts import LAYERS, MOE_LAYOUTS


@dataclass(frozen=True, slots=True)
class SmoothMapping:
    prev: str  # module whose output feeds `linears` (a norm, or a Linear), relative to the layer
    linears: tuple[str, ...]  # Linears reading that output, relative to the layer
    inspect: (
        str  # submodule whose output measures the error of a scale (AWQ), relative to the layer
    )


@dataclass(frozen=True, slots=True)
class ArchMapping:
    layers: str  # path of the decoder layer ModuleList
    sequential: tuple[
        tuple[str, ...], ...
    ]  # Linear groups quantized in order inside a layer (GPTQ)
    smooth: tuple[SmoothMapping, ...]  # equivalence-transform mappings (AWQ, SmoothQuant)
    q_proj: str = "self_attn.q_proj"  # attention projections (KV-cache calibration, pruning)
    k_proj: str = "self_attn.k_proj"
    v_proj: str = "self_attn.v_proj"
    o_proj: str = "self_attn.o_proj"
    attention: str = "self_attn"
    final_norm: str = "model.norm"  # the norm between the last decoder layer and lm_head
    # The decoder layer returns the input of this module (the residual stream after attention)
    # plus the output of the last Linear of `sequential` (down_proj), so a stage holding that
    # Linear's inputs can finish the layer's outputs without replaying it; None: it cannot.
    mlp_residual: str | None = "post_attention_layernorm"
    # Further Linears that read one tensor (GPTQ shares their Hessian) but that `smooth` does not
    # list: each expert's gate and up (the norm before them also feeds the router).
    shared_input: tuple[tuple[str, ...], ...] = ()


_LLAMA = ArchMapping(
    layers="model.layers",
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    smooth=(
        SmoothMapping(
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn",
        ),
        SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        SmoothMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
)

# Gemma 2 / Gemma 3 text: four norms per layer; pre_feedforward_layernorm feeds gate/up. The
# norms compute x * (1 + w), so dividing their weight by a scale (compress/quant/smoothing.py
# `apply_smooth_scale`) does not divide their output: no norm -> Linear smoothing mapping, only
# the exact Linear -> Linear ones (v -> o; up -> down: act(gate) * up is linear in up). q/k/v
# and gate/up still share one Hessian each (`shared_input`). The layer ends in
# post_feedforward_layernorm(down_proj(...)), not residual + down_proj: no `mlp_residual`.
_GEMMA = ArchMapping(
    layers="model.layers",
    sequential=_LLAMA.sequential,
    smooth=(
        SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    mlp_residual=None,
    shared_input=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ),
)

# Phi-3: q/k/v and gate/up are one Linear each on disk (qkv_proj, gate_up_proj). The norms are
# Llama's, so input_layernorm -> qkv_proj and post_attention_layernorm -> gate_up_proj are exact;
# v -> o and up -> down are left out: v's and up's rows share one Linear with q/k and gate, whose
# outputs a scale on that Linear's rows would change too. No separate k/v projection: the
# kv_cache stage refuses it (compress/quant/kv_cache.py `check_kv_architecture`).
_PHI3 = ArchMapping(
    layers="model.layers",
    sequential=(
        ("self_attn.qkv_proj",),
        ("self_attn.o_proj",),
        ("mlp.gate_up_proj",),
        ("mlp.down_proj",),
    ),
    smooth=(
        SmoothMapping("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
        SmoothMapping("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    ),
)

# Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norms after the projections) share one
# layout: the per-head norms of Qwen3 act on projection outputs, so input-side scaling is exact.
ARCHITECTURES: dict[str, ArchMapping] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "phi3": _PHI3,
}


def moe_mapping(model_type: str, config) -> ArchMapping:
    """The mapping of a mixture-of-experts model (runtime/loading/moe_experts.py `MOE_LAYOUTS`)
    with per-expert Linears under their checkpoint names, generated from `config`'s expert count.

    Sequential groups: q/k/v, o, then every expert's gate and up (with the shared expert's, and a
    dense layer's mlp.gate_proj/up_proj where the config has dense layers), then every down.
    Smoothing mappings are the exact ones only: input_layernorm -> q/k/v, v -> o, and each
    expert's (and the shared expert's) up -> down, whose output reaches nothing but that down.
    post_attention_layernorm -> the experts' gate/up is left out on purpose: that norm also feeds
    the router (and Qwen2-MoE's shared expert and its gate), which a scale on the experts alone
    would change, so AWQ and SmoothQuant do not smooth it in sparse layers (they do in a dense
    layer's MLP). A sparse block does not end in `residual + down_proj(x)`: mlp_residual is None.
    """
    layout = MOE_LAYOUTS[model_type]
    num = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    block = layout.disk_block
    g, u, d = layout.proj
    experts = [f"{block}.experts.{e}" for e in range(num)]
    dense = bool(getattr(config, "mlp_only_layers", None)) or (
        getattr(config, "decoder_sparse_step", 1) > 1
    )
    gate_up: list[str] = ["mlp.gate_proj", "mlp.up_proj"] if dense else []
    down: list[str] = ["mlp.down_proj"] if dense else []
    smooth = [
        SmoothMapping(
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn",
        ),
        SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    ]
    if dense:
        smooth += [
            SmoothMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
            SmoothMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
        ]
    shared = [f"{block}.shared_expert"] if model_type == "qwen2_moe" else []
    shared_input = []
    for owner, (og, ou, od) in [(s, ("gate_proj", "up_proj", "down_proj")) for s in shared] + [
        (e, (g, u, d)) for e in experts
    ]:
        gate_up += [f"{owner}.{og}", f"{owner}.{ou}"]
        down.append(f"{owner}.{od}")
        shared_input.append((f"{owner}.{og}", f"{owner}.{ou}"))
        smooth.append(SmoothMapping(f"{owner}.{ou}", (f"{owner}.{od}",), f"{owner}.{od}"))
    return ArchMapping(
        layers=LAYERS,
        sequential=(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("self_attn.o_proj",),
            tuple(gate_up),
            tuple(down),
        ),
        smooth=tuple(smooth),
        mlp_residual=None,
        shared_input=tuple(shared_input),
    )


# The sparse architectures: their entries here say where the layers are (the pipeline and the
# layer store read only that); `mapping_for` builds the full mapping from the model's config.
for _moe_type in MOE_LAYOUTS:
    ARCHITECTURES[_moe_type] = ArchMapping(
        layers=LAYERS, sequential=(), smooth=(), mlp_residual=None
    )


def mapping_for(model: nn.Module) -> ArchMapping:
    """The mapping of `model`'s architecture, or a clear refusal naming the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported by calibrated stages; supported: "
            f"{', '.join(sorted(ARCHITECTURES))} (rtn works on any model)"
        )
    if model_type in MOE_LAYOUTS:
        return moe_mapping(model_type, config)
    return ARCHITECTURES[model_type]


def decoder_layers(model: nn.Module, mapping: ArchMapping) -> nn.ModuleList:
    return model.get_submodule(mapping.layers)
