"""The `smoothquant` stage: migrate activation outliers into the weights before W8A8 quantization.

It only rescales norm weights and the Linears they feed (an equivalence transform), so the model
computes the same function afterwards and `state.quantized` stays untouched; a quantizer follows:

    - smoothquant: {alpha: 0.8}
    - rtn: {scheme: W8A8}

Per decoder layer: one replay records max |x| per input channel of every norm -> Linears
mapping (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up); the closed-form scale
(smoothquant.py) is then applied (smoothing.py). Mappings whose prev is a Linear are skipped, as
in the reference.
"""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel, ConfigDict, Field

from slimserve.compress.quant.smoothing import (
    apply_smooth_scale,
    refuse_after_quantizer,
    round_sig,
    skip_reason,
)
from slimserve.compress.quant.smoothquant import smoothquant_scales
from slimserve.compress.stage import CompressionState, LayerContext, Stage, StageReport
from slimserve.compress.targets import check_patterns, check_reach


class SmoothQuantOptions(BaseModel):
    """Options of the `smoothquant` stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alpha: float = Field(
        0.8, ge=0.0, le=1.0
    )  # migration strength: 0 keeps activations, 1 flattens them
    ignore: list[str] = []  # modules never rescaled (a mapping touching one is skipped)


class SmoothQuantStage(Stage):
    """Compute and apply SmoothQuant scales, layer by layer."""

    name = "smoothquant"
    needs_calibration = True
    layerwise = True

    def __init__(self, options: SmoothQuantOptions):
        self.options = options
        self.report = StageReport(
            self.name, details={"alpha": options.alpha, "mappings": [], "skipped": {}}
        )
        self._t0 = 0.0

    def prepare(self, state: CompressionState) -> None:
        self._t0 = time.perf_counter()
        check_patterns(state.model, self.options.ignore, f"stages.{self.name}.ignore")
        check_reach(state.model, ["Linear"], self.options.ignore, self.name)
        refuse_after_quantizer(state, self.name)

    @torch.no_grad()
    def compress_layer(self, ctx: LayerContext) -> None:
        active, stats, handles = [], [], []
        for m in ctx.mapping.smooth:
            reason = skip_reason(ctx, m, self.options.ignore, norm_only=True)
            if reason:
                self.report.details["skipped"][m.prev] = reason
                continue
            active.append(m)
            stats.append(_AbsMax())
            handles.append(ctx.module(m.linears[0]).register_forward_pre_hook(stats[-1]))
        if not active:
            return
        try:
            ctx.forward()  # statistics of the unsmoothed layer; smoothing one mapping leaves the others' inputs
        finally:
            for h in handles:
                h.remove()
        for m, st in zip(active, stats):
            lins = [ctx.module(r) for r in m.linears]
            act = st.value
            w_before = max(lin.weight.abs().max().item() for lin in lins)
            s = smoothquant_scales(act, [lin.weight for lin in lins], self.options.alpha)
            apply_smooth_scale(ctx.module(m.prev), lins, s)
            self.report.details["mappings"].append(
                {
                    "layer": ctx.index,
                    "prev": m.prev,
                    "linears": list(m.linears),
                    "scale_min": round_sig(s.min().item()),
                    "scale_max": round_sig(s.max().item()),
                    "act_absmax_before": round_sig(act.max().item()),
                    "act_absmax_after": round_sig((act / s).max().item()),
                    "weight_absmax_before": round_sig(w_before),
                    "weight_absmax_after": round_sig(
                        max(lin.weight.abs().max().item() for lin in lins)
                    ),
                }
            )

    def finalize(self, state: CompressionState) -> StageReport:
        self.report.seconds = time.perf_counter() - self._t0
        return self.report


class _AbsMax:
    """Forward pre-hook keeping max |x| per input channel over every token."""

    def __init__(self):
        self.value: torch.Tensor | None = None  # [K] running max |x| in fp32

    def __call__(self, _module, inputs):
        x = inputs[0].detach().float()
        m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0)
        self.value = m if self.value is None else torch.maximum(self.value, m)
