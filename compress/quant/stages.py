"""Quantization stages. `rtn`: round-to-nearest weight quantization, the baseline quantizer."""

from __future__ import annotations

import dataclasses
import time

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from slimserve.compress.quant.activations import attach_input_quant
from slimserve.compress.quant.primitives import quantize_weight
from slimserve.compress.stage import CompressionState, ModuleReport, Stage, StageReport
from slimserve.compress.targets import check_patterns, check_reach, select_linears
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantScheme, SchemeError, preset


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


class RtnStage(Stage):
    """Quantize every targeted Linear with min/max scales, no data needed."""

    name = "rtn"

    def __init__(self, options: RtnOptions):
        self.options = options
        self.scheme = options.resolve_scheme()
        self.report = StageReport(self.name, details={"scheme": describe_scheme(self.scheme)})

    def grouped_linears(self, model: nn.Module) -> dict[str, nn.Linear]:
        return select_linears(model, self.options.targets, self.options.ignore)

    def prepare(self, state: CompressionState) -> None:
        check_patterns(state.model, self.options.targets, f"stages.{self.name}.targets")
        check_patterns(state.model, self.options.ignore, f"stages.{self.name}.ignore")
        check_reach(state.model, self.options.targets, self.options.ignore, self.name)

    @torch.no_grad()
    def apply(self, state: CompressionState) -> None:
        t0 = time.perf_counter()
        args = self.scheme.weights
        for name, lin in select_linears(
            state.model, self.options.targets, self.options.ignore
        ).items():
            qw = quantize_weight(lin.weight.data, args, state.storage_dtype)
            self.report.modules.append(write_quantized(state, name, lin, qw, self.scheme))
        self.report.seconds = time.perf_counter() - t0

    def finalize(self, state: CompressionState) -> StageReport:
        self.report.details["modules_quantized"] = len(self.report.modules)
        return self.report


@torch.no_grad()
def write_quantized(
    state: CompressionState, name: str, lin: nn.Linear, qw: QuantizedWeight, scheme: QuantScheme
) -> ModuleReport:
    """Write a quantized weight back (rtn, gptq): the Linear keeps what a loader dequantizes (the
    storage-dtype values, upcast to its own dtype, on its device), `state` records the weight (on
    the CPU) and its scheme, and W8A8 schemes attach the input fake-quant. Returns the module's
    report line (relative Frobenius error of the weight)."""
    w = lin.weight.data
    w_hat = qw.dequantize(state.storage_dtype).to(device=w.device, dtype=w.dtype)
    err = (torch.linalg.norm(w.float() - w_hat.float()) / torch.linalg.norm(w.float())).item()
    lin.weight.data.copy_(w_hat)
    state.quantized[name] = _to_cpu(qw)
    state.schemes[name] = scheme
    if scheme.input_activations is not None:
        attach_input_quant(lin, scheme.input_activations)
    return ModuleReport(name, err, qw.args.num_bits)


def _to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    move = lambda t: None if t is None else t.cpu()  # noqa: E731
    return dataclasses.replace(
        qw,
        codes=move(qw.codes),
        scale=move(qw.scale),
        zero_point=move(qw.zero_point),
        g_idx=move(qw.g_idx),
    )


def describe_scheme(s: QuantScheme) -> dict:
    """The weight scheme as a report-friendly dict."""
    w = s.weights
    return {
        "num_bits": w.num_bits,
        "symmetric": w.symmetric,
        "strategy": w.strategy,
        "group_size": w.group_size,
    }
