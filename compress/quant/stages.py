"""Quantization stages. `rtn`: round-to-nearest weight quantization, the baseline quantizer."""

from __future__ import annotations

import time

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from slimserve.compress.quant.activations import attach_input_quant
from slimserve.compress.quant.primitives import quantize_weight
from slimserve.runtime.artifact.scheme import QuantScheme, SchemeError, preset
from slimserve.compress.stage import CompressionState, ModuleReport, StageReport
from slimserve.compress.targets import check_patterns, select_linears


class WeightQuantOptions(BaseModel):
    """Options every weight quantizer shares: the scheme and which Linears it covers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: str = "W4A16"  # preset name: W4A16, W4A16_ASYM, W3A16, W8A16, W8A8
    bits: int | None = None  # override the preset's bits (2, 3, 4, 8)
    group_size: int | None = Field(None, ge=-1)  # override the group size; -1 = per output channel
    symmetric: bool | None = None  # override the preset's symmetry
    targets: list[str] = ["Linear"]  # modules to quantize: names, 're:<regex>' or class names
    ignore: list[str] = ["lm_head"]  # modules left in the model dtype

    @model_validator(mode="after")
    def _check_scheme(self):
        try:
            self.resolve_scheme()
        except SchemeError as e:
            raise ValueError(str(e)) from None
        return self

    def resolve_scheme(self) -> QuantScheme:
        s = preset(self.scheme)
        if self.group_size is not None:
            s = s.with_group_size(self.group_size)
        w = s.weights
        if self.bits is not None:
            w = w.with_(num_bits=self.bits)
        if self.symmetric is not None:
            w = w.with_(symmetric=self.symmetric)
        return QuantScheme(w, s.input_activations)


class RtnOptions(WeightQuantOptions):
    """Options of the `rtn` stage (data-free, so nothing beyond the shared ones)."""


class RtnStage:
    """Quantize every targeted Linear with min/max scales, no data needed."""

    name = "rtn"
    needs_calibration = False
    layerwise = False

    def __init__(self, options: RtnOptions):
        self.options = options
        self.scheme = options.resolve_scheme()
        self.report = StageReport(self.name, details={"scheme": describe_scheme(self.scheme)})

    def prepare(self, state: CompressionState) -> None:
        check_patterns(state.model, self.options.targets, f"stages.{self.name}.targets")
        check_patterns(state.model, self.options.ignore, f"stages.{self.name}.ignore")

    @torch.no_grad()
    def apply(self, state: CompressionState) -> None:
        t0 = time.perf_counter()
        args = self.scheme.weights
        for name, lin in select_linears(state.model, self.options.targets, self.options.ignore).items():
            w = lin.weight.data
            qw = quantize_weight(w, args, state.storage_dtype)
            # The model keeps what a loader will dequantize: storage-dtype values, upcast.
            w_hat = qw.dequantize(state.storage_dtype).to(w.dtype)
            err = (torch.linalg.norm((w.float() - w_hat.float())) / torch.linalg.norm(w.float())).item()
            lin.weight.data.copy_(w_hat)
            state.quantized[name] = qw
            state.schemes[name] = self.scheme
            if self.scheme.input_activations is not None:
                attach_input_quant(lin, self.scheme.input_activations)
            self.report.modules.append(ModuleReport(name, err, args.num_bits))
        self.report.seconds = time.perf_counter() - t0

    def finalize(self, state: CompressionState) -> StageReport:
        self.report.details["modules_quantized"] = len(self.report.modules)
        return self.report


def describe_scheme(s: QuantScheme) -> dict:
    """The weight scheme as a report-friendly dict."""
    w = s.weights
    return {"num_bits": w.num_bits, "symmetric": w.symmetric, "strategy": w.strategy, "group_size": w.group_size}
