"""Per-architecture layer mappings: where the decoder layers are, which norm feeds which Linears.

Stages never branch on class names (docs/architecture.md, "A new architecture"): they look the
model's `config.model_type` up here. An architecture missing from `ARCHITECTURES` is refused
with the list of supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from slimserve.compress.errors import UnsupportedModelError


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

# Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norms after the projections) share one
# layout: the per-head norms of Qwen3 act on projection outputs, so input-side scaling is exact.
ARCHITECTURES: dict[str, ArchMapping] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
}


def mapping_for(model: nn.Module) -> ArchMapping:
    """The mapping of `model`'s architecture, or a clear refusal naming the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported by calibrated stages; supported: "
            f"{', '.join(sorted(ARCHITECTURES))} (rtn works on any model)"
        )
    return ARCHITECTURES[model_type]


def decoder_layers(model: nn.Module, mapping: ArchMapping) -> nn.ModuleList:
    return model.get_submodule(mapping.layers)
