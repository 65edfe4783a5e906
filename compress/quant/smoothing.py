"""The equivalence transform shared by AWQ and SmoothQuant: move a per-channel scale across a pair.

For input channel j of the Linears that read `prev`'s output, `prev`'s output is divided by s_j
and the Linears' column j is multiplied by s_j, so (x / s) @ (W * s)^T = x @ W^T and the model
computes the same function (up to float rounding). Only the *search* for s differs between AWQ
(quantization-aware grid search) and SmoothQuant (closed form); both apply it here.
"""

from __future__ import annotations

import torch
from torch import nn

from slimserve.compress.errors import RecipeError
from slimserve.compress.mappings import SmoothMapping, decoder_layers, mapping_for
from slimserve.compress.stage import CompressionState, LayerContext
from slimserve.runtime.artifact.targets import matches


@torch.no_grad()
def apply_smooth_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Divide `prev`'s output channels by `s` [K] and multiply the Linears' input columns by it.

    `prev` is a norm (its `weight` [K] and optional `bias` [K] are divided) or a Linear, whose
    *last* K output rows (and bias entries) are divided: that covers v_proj -> o_proj and fused
    projections such as Wqkv whose tail is the value part. A norm with a (1 + w) weight (Gemma)
    is not supported: no architecture in mappings.py has one.
    """
    k = s.numel()
    if s.dim() != 1 or not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
        raise ValueError(
            f"smoothing scale must be a finite positive 1-D tensor, got shape {tuple(s.shape)}"
        )
    for lin in linears:
        if lin.in_features != k:
            raise ValueError(
                f"{lin} reads {lin.in_features} input channels but the scale has {k}; "
                "a mapping's Linears must read the output of its prev module"
            )
    sf = s.float()
    if isinstance(prev, nn.Linear):
        if prev.out_features < k:
            raise ValueError(
                f"prev Linear has {prev.out_features} output rows, fewer than the {k} channels "
                "to scale (grouped-query attention?); skip this mapping"
            )
        _div_rows(prev.weight, sf)
    else:
        if getattr(prev, "weight", None) is None or prev.weight.shape != (k,):
            raise ValueError(
                f"prev module {type(prev).__name__} needs a weight of shape ({k},) to absorb the scale"
            )
        prev.weight.copy_((prev.weight.float() / sf).to(prev.weight.dtype))
    bias = getattr(prev, "bias", None)
    if bias is not None:
        bias[-k:] = (bias[-k:].float() / sf).to(bias.dtype)
    for lin in linears:
        lin.weight.copy_((lin.weight.float() * sf).to(lin.weight.dtype))


def _div_rows(weight: torch.Tensor, s: torch.Tensor) -> None:
    """weight [N, *] with N >= K: divide the last K rows by s [K] (one factor per row)."""
    k = s.numel()
    tail = weight[-k:]
    tail.copy_((tail.float() / s.unsqueeze(1)).to(weight.dtype))


# ---- stage-side helpers shared by the `awq` and `smoothquant` stages ----------------------------


def skip_reason(
    ctx: LayerContext, m: SmoothMapping, ignore: list[str], norm_only: bool = False
) -> str | None:
    """Why mapping `m` of this layer cannot or must not be scaled, or None to scale it."""
    for rel in (m.prev, *m.linears):
        try:
            ctx.module(rel)
        except AttributeError:  # a dense layer's MLP mapping in a sparse layer, or the reverse
            return f"{rel} is not in this layer"
    for rel in (m.prev, *m.linears):
        if matches(f"{ctx.prefix}.{rel}", ctx.module(rel), ignore):
            return f"{rel} matches ignore"
    prev, first = ctx.module(m.prev), ctx.module(m.linears[0])
    if isinstance(prev, nn.Linear):
        if norm_only:
            return "prev is a Linear; SmoothQuant smooths norm outputs only"
        if prev.out_features < first.in_features:
            return (
                f"{m.prev} has {prev.out_features} output rows but {m.linears[0]} reads "
                f"{first.in_features} channels (grouped-query attention)"
            )
    return None


def refuse_after_quantizer(state: CompressionState, stage: str) -> None:
    """An equivalence transform on already-quantized weights would undo the quantization."""
    mapping = mapping_for(state.model)
    for i in range(len(decoder_layers(state.model, mapping))):
        for m in mapping.smooth:
            for rel in m.linears:
                name = f"{mapping.layers}.{i}.{rel}"
                if name in state.quantized:
                    raise RecipeError(
                        f"stages.{stage}: {name} is already quantized; {stage} rescales weights "
                        f"and must run before the quantizer, so move '- {stage}' above rtn/gptq"
                    )


def round_sig(x: float, digits: int = 6) -> float:
    """`x` with `digits` significant digits, for compact report details."""
    return float(f"{x:.{digits}g}")
