"""The `gptq` stage: collect each Linear's input Hessian layer by layer and quantize it with GPTQ.

Inside a decoder layer the Linears are quantized true-sequentially in the architecture mapping's
groups ([q,k,v], [o], [gate,up], [down]): pre-hooks collect H for one group while the cached
calibration inputs are replayed (each batch stops once the group's inputs are seen), the group is
quantized and written back as fake-quant weights, and only then is the next group's H collected,
so it sees the already-quantized earlier groups. Linears that read one input (q/k/v, gate/up)
share one H, one factorization and one GPTQ column loop (compress/quant/gptq.py `gptq_shared`).
The calibration engine then feeds the compressed layer's outputs to the next layer; when the
mapping says the layer ends in `residual + down_proj(x)` (ArchMapping.mlp_residual), the stage
computes them itself from the inputs kept while down_proj's H was collected, skipping a replay.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from slimserve.compress.mappings import mapping_for
from slimserve.compress.moe import expert_tokens, starved_notes
from slimserve.compress.quant.gptq import accumulate_hessian, gptq_shared, output_loss
from slimserve.compress.quant.primitives import quantize_weight
from slimserve.compress.quant.stages import WeightQuantOptions, write_quantized
from slimserve.compress.stage import CompressionState, LayerContext, Stage, StageReport
from slimserve.compress.targets import check_patterns, check_reach, select_linears
from slimserve.runtime.artifact.scheme import QuantScheme, SchemeError
from slimserve.runtime.loading.lazy_weights import available_memory

# The RTN comparison in the report is estimated on at most this many evenly spaced rows of a
# Linear (GPTQ's own loss comes from its loop, over every row, at no cost).
RTN_LOSS_ROWS = 1024


class GptqOptions(WeightQuantOptions):
    """Options of the `gptq` stage: the shared weight options plus GPTQ's own."""

    block_size: int = Field(128, gt=0)  # columns per lazy-update block (speed only, not results)
    dampening_frac: float = Field(0.01, gt=0, le=1)  # added to diag(H), as a fraction of its mean
    # Column order: 'static' = descending diag(H) with the original groups (no g_idx on disk);
    # 'group' = groups formed in that order (g_idx on disk); null = natural order.
    actorder: Literal["static", "group"] | None = "static"
    # Mixture-of-experts models: every expert's Hessian sees every calibration token while the
    # layer's output still follows the router (compress/moe.py); false: routed tokens only.
    calibrate_all_experts: bool = True

    def resolve_scheme(self) -> QuantScheme:
        """The preset with overrides; the default act-order applies to group strategies only."""
        s = super().resolve_scheme()
        w = s.weights
        if w.strategy != "group":
            if self.actorder is not None and "actorder" in self.model_fields_set:
                raise SchemeError(
                    f"actorder={self.actorder!r} needs strategy 'group', but scheme {self.scheme} "
                    f"(group_size={self.group_size}) is per {w.strategy}; remove actorder or set "
                    "a group_size such as 128"
                )
            return s
        return QuantScheme(w.with_(actorder=self.actorder), s.input_activations)


class GptqStage(Stage):
    """GPTQ every targeted Linear inside the decoder layers; RTN for targeted ones outside."""

    name = "gptq"
    needs_calibration = True
    layerwise = True
    replay_in_storage_dtype = True  # only input statistics: replays may run in bf16

    def __init__(self, options: GptqOptions):
        self.options = options
        self.scheme = options.resolve_scheme()
        self.calibrate_all_experts = options.calibrate_all_experts
        w = self.scheme.weights
        self.report = StageReport(
            self.name,
            details={
                "scheme": {
                    "num_bits": w.num_bits,
                    "symmetric": w.symmetric,
                    "strategy": w.strategy,
                    "group_size": w.group_size,
                    "actorder": w.actorder,
                    "input_activations": self.scheme.input_activations is not None,
                },
                "block_size": options.block_size,
                "dampening_frac": options.dampening_frac,
                "calibrate_all_experts": options.calibrate_all_experts,
            },
        )
        self._tokens: dict[str, int] = {}  # module -> calibration tokens its H saw
        self._targets: dict[str, nn.Linear] = {}  # targeted Linears, model order
        self._outside: list[str] = []  # targeted Linears outside the decoder layers (RTN)
        self._losses: dict[str, dict[str, float]] = {}  # module -> gptq_loss, rtn_loss, damp
        self._fallbacks: dict[str, str] = {}  # module -> why RTN was used
        self._notes: list[str] = []  # facts for the report
        self._t0 = 0.0  # perf_counter at prepare()

    def grouped_linears(self, model: nn.Module) -> dict[str, nn.Linear]:
        return select_linears(model, self.options.targets, self.options.ignore)

    def prepare(self, state: CompressionState) -> None:
        self._t0 = time.perf_counter()
        check_patterns(state.model, self.options.targets, f"stages.{self.name}.targets")
        check_patterns(state.model, self.options.ignore, f"stages.{self.name}.ignore")
        check_reach(state.model, self.options.targets, self.options.ignore, self.name)
        layers = mapping_for(state.model).layers + "."
        self._targets = select_linears(state.model, self.options.targets, self.options.ignore)
        self._outside = [n for n in self._targets if not n.startswith(layers)]

    @torch.no_grad()
    def compress_layer(self, ctx: LayerContext) -> None:
        groups = self._groups(ctx)
        finisher = _finishing_linear(ctx, groups)
        for group in groups:
            keep = _KeptInputs(finisher) if group == [finisher] else None
            for readers, h, count in _collect_hessians(ctx, group, keep):
                names = [f"{ctx.prefix}.{rel}" for rel in readers]
                self._tokens.update(dict.fromkeys(names, count))
                if count == 0:
                    self._notes += [
                        f"{n} received no calibration tokens; its H is 0, so GPTQ = RTN"
                        for n in names
                    ]
                self._quantize(ctx.state, names, [ctx.module(rel) for rel in readers], h)
            if keep:
                ctx.outputs = _finish_outputs(ctx, keep)

    def _groups(self, ctx: LayerContext) -> list[list[str]]:
        """This layer's targeted Linears (relative names) in true-sequential groups."""
        head = ctx.prefix + "."
        targeted = [n[len(head) :] for n in self._targets if n.startswith(head)]
        groups = [[r for r in grp if r in targeted] for grp in ctx.mapping.sequential]
        covered = {r for grp in ctx.mapping.sequential for r in grp}
        rest = [r for r in targeted if r not in covered]  # Linears the mapping does not list
        return [g for g in groups + [rest] if g]

    def _quantize(
        self, state: CompressionState, names: list[str], lins: list[nn.Linear], h: torch.Tensor
    ) -> None:
        """GPTQ of Linears that read one input (one H, one factorization: gptq_shared), written back."""
        args, opts = self.scheme.weights, self.options
        ws = [
            lin.weight.data.float() for lin in lins
        ]  # the layer may replay in bf16 (calibration.dtype)
        results = gptq_shared(
            ws, h, args, state.storage_dtype, opts.block_size, opts.dampening_frac
        )
        for name, lin, w, res in zip(names, lins, ws, results):
            rtn = quantize_weight(
                w.cpu(), args, state.storage_dtype
            )  # RTN's min/max runs on CPU only
            rtn_loss = output_loss(w, rtn.dequantize(torch.float32).to(w.device), h, RTN_LOSS_ROWS)
            self._losses[name] = {"gptq_loss": res.loss, "rtn_loss": rtn_loss, "damp": res.damp}
            if res.fallback:
                self._fallbacks[name] = res.fallback
            self.report.modules.append(write_quantized(state, name, lin, res.qweight, self.scheme))

    @torch.no_grad()
    def finalize(self, state: CompressionState) -> StageReport:
        for name in self._outside:
            lin = self._targets[name]
            qw = quantize_weight(lin.weight.data.cpu(), self.scheme.weights, state.storage_dtype)
            self.report.modules.append(write_quantized(state, name, lin, qw, self.scheme))
            self._notes.append(
                f"{name} is outside the decoder layers (no calibrated inputs): quantized with RTN"
            )
        d = self.report.details
        d["modules_quantized"] = len(self.report.modules)
        d["losses"] = self._losses
        d["loss_ratio"] = _ratio_summary(self._losses)
        d["rtn_loss_rows"] = (
            f"rtn_loss of a Linear with more than {RTN_LOSS_ROWS} output rows is the mean "
            f"over every ceil(rows / {RTN_LOSS_ROWS})-th row"
        )
        d["fallbacks"] = self._fallbacks
        per_expert = expert_tokens(self._tokens)
        if per_expert:
            d["expert_tokens"] = per_expert
            for note in starved_notes(per_expert, self.name, self.calibrate_all_experts):
                warnings.warn(f"gptq: {note}", RuntimeWarning, stacklevel=2)
                self._notes.append(note)
        d["notes"] = self._notes
        self.report.seconds = time.perf_counter() - self._t0
        return self.report


_KEEP_FRACTION = 0.125  # keep them when they take at most this share of the available memory
_KEEP_DEFAULT_BYTES = 8 * 2**30  # the available memory assumed where the OS does not say


@dataclass(slots=True)
class _KeptInputs:
    """Per batch, on the CPU: the finishing Linear's inputs and the residual beside them."""

    rel: str  # the finishing Linear (`_finishing_linear`)
    inputs: list[torch.Tensor] = field(default_factory=list)
    residual: list[torch.Tensor] = field(default_factory=list)  # inputs of ArchMapping.mlp_residual


class _Collected(Exception):
    """Raised by the last Hessian pre-hook of a replay: nothing after those inputs is needed."""


def _collect_hessians(
    ctx: LayerContext, rels: list[str], keep: _KeptInputs | None = None
) -> list[tuple[list[str], torch.Tensor, int]]:
    """Replay the layer up to the inputs of `rels`: (readers, H [K, K] fp32, tokens) per input.

    Linears that read one tensor (q/k/v after the input norm, gate/up: the mapping's smooth
    groups) share one accumulation, and GPTQ then factors that H once for all of them. H only
    needs a Linear's input, so each batch stops in a pre-hook as soon as every input of the group
    has been seen: the group's own Linears and everything after them never run (the q/k/v replay
    is the input norm alone, the down_proj one skips down_proj).

    With `keep`, each batch's input of its Linear and of the mapping's `mlp_residual` module are
    also kept there, for `_finish_outputs`.
    """
    owner = {rel: rel for rel in rels}
    for linears in [m.linears for m in ctx.mapping.smooth] + list(ctx.mapping.shared_input):
        readers = [rel for rel in linears if rel in owner]
        for rel in readers:
            owner[rel] = readers[0]
    hessians: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    pending: set[str] = set()
    handles = []
    if keep:
        handles.append(
            ctx.module(ctx.mapping.mlp_residual).register_forward_pre_hook(
                lambda _mod, args: keep.residual.append(args[0].detach().to("cpu", copy=True))
            )
        )
    for rel in dict.fromkeys(owner.values()):
        lin = ctx.module(rel)
        hessians[rel] = torch.zeros(
            lin.in_features, lin.in_features, dtype=torch.float32, device=lin.weight.device
        )
        counts[rel] = 0

        def hook(_mod, args, rel=rel):
            if keep and rel == keep.rel:
                keep.inputs.append(args[0].detach().to("cpu", copy=True))
            counts[rel] = accumulate_hessian(hessians[rel], args[0].detach(), counts[rel])
            pending.discard(rel)
            if not pending:
                raise _Collected

        handles.append(lin.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for hidden, kwargs in zip(ctx.inputs.hidden, ctx.inputs.kwargs):
                pending.update(hessians)
                try:
                    ctx.layer(hidden.to(ctx.device), **_on_device(kwargs, ctx.device))
                except _Collected:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return [
        ([r for r in rels if owner[r] == first], hessians[first], counts[first])
        for first in hessians
    ]


def _finishing_linear(ctx: LayerContext, groups: list[list[str]]) -> str | None:
    """The Linear whose quantization finishes the layer, when its outputs can be computed from
    that Linear's inputs (see ArchMapping.mlp_residual) and keeping those fits in memory; else None.

    The layer's outputs are then `residual + down_proj(x)` with the inputs kept while down_proj's
    H was collected: bit-identical to replaying the quantized layer (the same operations on the
    same tensors, tests/integration/test_gptq_stage.py) at the cost of one Linear instead of a
    whole layer forward (the calibration engine's replay for the next layer's inputs).
    """
    m = ctx.mapping
    if (
        m.mlp_residual is None
        or not groups
        or len(groups[-1]) != 1
        or tuple(groups[-1]) != m.sequential[-1]
    ):
        return None
    rel, hidden = groups[-1][0], ctx.inputs.hidden
    if not hidden:
        return None
    # The residual is as wide as the layer's input, and both are kept in the replay's dtype.
    need = (
        sum(h.shape[:-1].numel() for h in hidden)
        * hidden[0].element_size()
        * (ctx.module(rel).in_features + hidden[0].shape[-1])
    )
    free = available_memory()
    return (
        rel
        if need <= (free if free is not None else _KEEP_DEFAULT_BYTES) * _KEEP_FRACTION
        else None
    )


def _finish_outputs(ctx: LayerContext, kept: _KeptInputs) -> list[torch.Tensor]:
    """The layer's outputs per batch (CPU): residual + the kept Linear (now quantized) on its inputs."""
    lin, outs = ctx.module(kept.rel), []
    for residual, x in zip(kept.residual, kept.inputs):
        outs.append((residual.to(ctx.device) + lin(x.to(ctx.device))).cpu())
    return outs


def _on_device(obj, device: torch.device):
    """Tensors inside the cached layer kwargs (tuples, lists, dicts) moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_on_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _on_device(v, device) for k, v in obj.items()}
    return obj


def _ratio_summary(losses: dict[str, dict[str, float]]) -> dict:
    """gptq/rtn output-loss ratios: geometric mean over modules, ratio of totals, count not worse."""
    ratios = [v["gptq_loss"] / v["rtn_loss"] for v in losses.values() if v["rtn_loss"] > 0]
    total_rtn = sum(v["rtn_loss"] for v in losses.values())
    return {
        "geomean": math.exp(sum(math.log(max(r, 1e-12)) for r in ratios) / len(ratios))
        if ratios
        else None,
        "total": sum(v["gptq_loss"] for v in losses.values()) / total_rtn
        if total_rtn > 0
        else None,
        "not_worse": sum(v["gptq_loss"] <= v["rtn_loss"] for v in losses.values()),
        "modules": len(losses),
    }
