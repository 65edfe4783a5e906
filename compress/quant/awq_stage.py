"""The `awq` stage: activation-aware scaling (and clipping) ahead of a weight quantizer.

It only rescales and clips weights; the quantizer that follows in the recipe (`rtn`, `gptq`)
quantizes them, so `awq` records nothing in `state.quantized`. Its `scheme` must describe what
that quantizer will do, because both searches measure the error of exactly that quantizer:

    - awq: {scheme: W4A16, group_size: 128}
    - rtn: {scheme: W4A16, group_size: 128}

Per decoder layer, for each mapping (prev -> Linears, inspected on a submodule) of
`mappings.py`: capture the inspected submodule's inputs, grid-search the scale (awq.py), apply
it (smoothing.py) unless no grid point beats plain RTN (then s = 1; the reference applies the
best grid point regardless). Then clip every Linear except q/k projections on `clip_tokens`
sampled inputs. `clip_in_search` (default) runs that clip search inside every scale candidate's
loss, so the scale is chosen for the clipped weights that will actually be quantized. With
`quantized_inputs` (default), the layer is left fake-quantized by the scheme while the engine
replays it to make the next layer's inputs, so layer i+1 is searched on what the quantized model
will feed it (as GPTQ is), and its weights are restored before the next layer is searched (and
at the end), so the quantizer that follows still sees the unquantized weights. The demo model's
drift with each option on and off is in docs/results-quality.md ("Quantization quality (measured)").

Cost: a scale candidate replays the inspected submodule (self_attn, mlp) on every calibration
token, except where that submodule is the mapping's one Linear (up_proj -> down_proj): there the
error |X (W_q - W)^T|^2 comes from a once-computed factor of X (`_linear_output_loss`), so no
candidate replays it. The clip searches (awq.py) quantize all shrink steps in one batched call
and measure them through a per-group factor of the sampled inputs. Both choose what the plain
loops choose (tests/compress/test_awq_vectorised.py).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from slimserve.compress.errors import RecipeError
from slimserve.compress.mappings import SmoothMapping, decoder_layers, mapping_for
from slimserve.compress.moe import dense_modules, expert_tokens, starved_notes
from slimserve.compress.quant.awq import awq_clip_search, awq_search_scale, fake_quantize
from slimserve.compress.quant.smoothing import (
    apply_smooth_scale,
    refuse_after_quantizer,
    round_sig,
    skip_reason,
)
from slimserve.compress.quant.stages import WeightQuantOptions, describe_scheme
from slimserve.compress.stage import CompressionState, LayerContext, Stage, StageReport
from slimserve.compress.targets import check_patterns, check_reach
from slimserve.runtime.artifact.scheme import QuantScheme, SchemeError
from slimserve.runtime.artifact.targets import matches

# Linears whose clipping AWQ skips: clipping q/k distorts attention scores (the reference's list).
_NO_CLIP = ("q_", "k_", "query", "key", "wqkv")
_CLIP_GRID, _CLIP_MAX_SHRINK = 20, 0.5  # shrink steps i/20 for i < 10 (reference values)


class AwqOptions(BaseModel):
    """Options of the `awq` stage. The scheme fields mirror the quantizer's (rtn/gptq) options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheme: str = "W4A16"  # scheme of the following quantizer (W4A16, the rtn/gptq default)
    bits: int | None = None  # override the preset's bits, as in the quantizer's options
    group_size: int | None = Field(None, ge=-1)  # override the group size; -1 = per output channel
    symmetric: bool | None = None  # override the preset's symmetry
    n_grid: int = Field(20, ge=2)  # scale-search grid points over [0, 1], both ends included
    duo_scaling: bool = True  # s = x^a / w^(1-a) (True) or s = x^a (False)
    clip: bool = True  # also search per-(row, group) clipping thresholds
    clip_tokens: int = Field(
        512, ge=1
    )  # input tokens the clip search sees per Linear (AutoAWQ: 512)
    quantized_inputs: bool = True  # next layer searched on this layer's fake-quantized outputs
    clip_in_search: bool = True  # score each scale candidate with its clip search applied first
    ignore: list[str] = []  # modules never rescaled or clipped (a mapping touching one is skipped)
    # Mixture-of-experts models: every expert's statistics see every calibration token while the
    # layer's output still follows the router (compress/moe.py); false: routed tokens only.
    calibrate_all_experts: bool = True

    @model_validator(mode="after")
    def _check_scheme(self):
        try:
            self.resolve_scheme()
        except SchemeError as e:
            raise ValueError(str(e)) from None
        return self

    def resolve_scheme(self) -> QuantScheme:
        return WeightQuantOptions.resolve_scheme(self)  # same preset + override rules as rtn/gptq


class AwqStage(Stage):
    """Search and apply AWQ scales and clipping thresholds, layer by layer."""

    name = "awq"
    needs_calibration = True
    layerwise = True
    handles_partial_groups = False  # the scale and clip searches reshape weights into whole groups

    def __init__(self, options: AwqOptions):
        self.options = options
        self.scheme = options.resolve_scheme()
        self.calibrate_all_experts = options.calibrate_all_experts
        self.report = StageReport(
            self.name,
            details={
                "scheme": describe_scheme(self.scheme),
                "calibrate_all_experts": options.calibrate_all_experts,
                "n_grid": options.n_grid,
                "duo_scaling": options.duo_scaling,
                "clip": options.clip,
                "clip_tokens": options.clip_tokens,
                "quantized_inputs": options.quantized_inputs,
                "clip_in_search": options.clip_in_search,
                "mappings": [],
                "skipped": {},
                "clipped": [],
            },
        )
        self._t0 = 0.0
        self._restore: list[tuple[nn.Linear, torch.Tensor]] = []  # (Linear, its unquantized weight)
        self._tokens: dict[str, int] = {}  # module -> calibration tokens its scale search saw

    def grouped_linears(self, model: nn.Module) -> dict[str, nn.Linear]:
        """Every Linear of the decoder layers: the searches quantize them all with the scheme."""
        prefix, dense = mapping_for(model).layers + ".", dense_modules(model)
        return {
            n: m
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.startswith(prefix) and n not in dense
        }

    def prepare(self, state: CompressionState) -> None:
        self._t0 = time.perf_counter()
        check_patterns(state.model, self.options.ignore, f"stages.{self.name}.ignore")
        check_reach(state.model, ["Linear"], self.options.ignore, self.name)
        refuse_after_quantizer(state, self.name)
        self._check_group_size(state.model)

    def compress_layer(self, ctx: LayerContext) -> None:
        self._restore_weights()  # the previous layer fed this one while fake-quantized
        for m in ctx.mapping.smooth:
            reason = skip_reason(ctx, m, self.options.ignore)
            if reason:
                self.report.details["skipped"][m.prev] = reason
                continue
            self._scale_mapping(ctx, m)
        if self.options.clip:
            self._clip_layer(ctx)
        if self.options.quantized_inputs:
            self._fake_quantize_layer(ctx)

    def finalize(self, state: CompressionState) -> StageReport:
        self._restore_weights()
        per_expert = expert_tokens(self._tokens)
        if per_expert:
            self.report.details["expert_tokens"] = per_expert
            notes = starved_notes(per_expert, self.name, self.calibrate_all_experts)
            for note in notes:
                warnings.warn(f"awq: {note}", RuntimeWarning, stacklevel=2)
            self.report.details["notes"] = notes
        self.report.seconds = time.perf_counter() - self._t0
        return self.report

    def _check_group_size(self, model: nn.Module) -> None:
        w = self.scheme.weights
        if w.strategy != "group":
            return
        layers = decoder_layers(model, mapping_for(model))
        for name, lin in layers.named_modules():
            if isinstance(lin, nn.Linear) and lin.in_features % w.group_size:
                raise RecipeError(
                    f"stages.{self.name}.group_size: {w.group_size} does not divide the "
                    f"{lin.in_features} inputs of {name}; use a group_size that divides it"
                )

    @torch.no_grad()
    def _scale_mapping(self, ctx: LayerContext, m: SmoothMapping) -> None:
        prev, lins = ctx.module(m.prev), [ctx.module(r) for r in m.linears]
        absmean, samples = _AbsMean(), []
        handles = [lins[0].register_forward_pre_hook(absmean)]
        clipped = [
            self.options.clip and self.options.clip_in_search and not _no_clip(r) for r in m.linears
        ]
        if any(clipped):
            handles.append(
                lins[0].register_forward_pre_hook(_sampler(samples, self._clip_step(ctx)))
            )
        try:
            calls = ctx.capture_calls(m.inspect, ctx.device)
        finally:
            for h in handles:
                h.remove()
        self._tokens.update(dict.fromkeys((f"{ctx.prefix}.{r}" for r in m.linears), absmean.count))
        if absmean.count == 0:  # an expert the router sent no calibration token
            self.report.details["skipped"][m.prev] = "no calibration tokens reached it"
            return
        orig = [lin.weight.detach().clone() for lin in lins]
        args, sdt = self.scheme.weights, ctx.state.storage_dtype
        x_clip = torch.cat(samples)[: self.options.clip_tokens] if samples else None  # [T, K]

        def quantized(w: torch.Tensor, clip: bool, s: torch.Tensor) -> torch.Tensor:
            """Q(W * s) / s, with the clip search of W * s (on inputs x / s) applied first if `clip`."""
            ws = w.float() * s
            if clip:
                ws = _clamp(
                    ws, awq_clip_search(ws, x_clip / s, args, _CLIP_GRID, _CLIP_MAX_SHRINK, sdt)
                )
            return fake_quantize(ws, args, sdt) / s

        if m.linears == (m.inspect,) and all(
            c[0] and isinstance(c[0][0], torch.Tensor) for c in calls
        ):
            loss = _linear_output_loss(calls, orig[0], lambda s: quantized(orig[0], clipped[0], s))
        else:
            loss = _module_output_loss(
                ctx,
                m.inspect,
                calls,
                lins,
                orig,
                lambda s: [quantized(w, c, s) for w, c in zip(orig, clipped)],
            )

        x_mean = absmean.value()
        loss_before = loss(torch.ones_like(x_mean))
        group = args.group_size if args.strategy == "group" else None
        s, ratio, losses = awq_search_scale(
            x_mean, torch.cat(orig), loss, self.options.n_grid, self.options.duo_scaling, group
        )
        # Duo scaling has no identity point on its grid; when no candidate beats plain RTN, keep s = 1.
        applied = min(losses) < loss_before
        if applied:
            apply_smooth_scale(prev, lins, s)
        self.report.details["mappings"].append(
            {
                "layer": ctx.index,
                "prev": m.prev,
                "linears": list(m.linears),
                "ratio": round_sig(ratio, 4),
                "applied": applied,
                "scale_min": round_sig(s.min().item()),
                "scale_max": round_sig(s.max().item()),
                "loss_before": round_sig(loss_before),
                "loss_after": round_sig(min(min(losses), loss_before)),
            }
        )

    @torch.no_grad()
    def _fake_quantize_layer(self, ctx: LayerContext) -> None:
        """Quantize this layer's Linears in place until the next compress_layer/finalize restores them."""
        args, sdt = self.scheme.weights, ctx.state.storage_dtype
        dense = _dense_rels(ctx)
        for rel, lin in ctx.layer.named_modules():
            if (
                isinstance(lin, nn.Linear)
                and rel not in dense
                and not matches(f"{ctx.prefix}.{rel}", lin, self.options.ignore)
            ):
                self._restore.append((lin, lin.weight.detach().to("cpu", copy=True)))
                lin.weight.copy_(fake_quantize(lin.weight, args, sdt).to(lin.weight.dtype))

    @torch.no_grad()
    def _restore_weights(self) -> None:
        for lin, w in self._restore:
            lin.weight.copy_(w)
        self._restore = []

    @torch.no_grad()
    def _clip_layer(self, ctx: LayerContext) -> None:
        dense = _dense_rels(ctx)
        targets = {
            rel: lin
            for rel, lin in ctx.layer.named_modules()
            if isinstance(lin, nn.Linear)
            and rel not in dense
            and not _no_clip(rel)
            and not matches(f"{ctx.prefix}.{rel}", lin, self.options.ignore)
        }
        n_tok, step = self.options.clip_tokens, self._clip_step(ctx)
        samples: dict[str, list[torch.Tensor]] = {rel: [] for rel in targets}
        handles = [
            lin.register_forward_pre_hook(_sampler(samples[rel], step))
            for rel, lin in targets.items()
        ]
        try:
            ctx.forward()  # inputs as the already-scaled layer sees them
        finally:
            for h in handles:
                h.remove()
        args = self.scheme.weights
        for rel, lin in targets.items():
            if not samples[rel]:  # an expert the router sent no calibration token: not clipped
                continue
            x = torch.cat(samples[rel])[:n_tok]
            w = lin.weight
            max_val = awq_clip_search(
                w, x, args, _CLIP_GRID, _CLIP_MAX_SHRINK, ctx.state.storage_dtype
            )
            org_max = w.float().abs().reshape(max_val.shape[0], max_val.shape[1], -1).amax(-1)
            w.copy_(_clamp(w.float(), max_val).to(w.dtype))
            self.report.details["clipped"].append(
                {
                    "module": f"{ctx.prefix}.{rel}",
                    "clipped_groups": round_sig((max_val < org_max).float().mean().item(), 4),
                    "mean_shrink": round_sig(
                        (1 - max_val / org_max.clamp(min=1e-30)).mean().item(), 4
                    ),
                }
            )

    def _clip_step(self, ctx: LayerContext) -> int:
        """Token stride that leaves about `clip_tokens` of the layer's calibration tokens."""
        total = sum(h.shape[0] * h.shape[1] for h in ctx.inputs.hidden)
        return max(1, total // self.options.clip_tokens)


def _module_output_loss(
    ctx: LayerContext,
    inspect: str,
    calls: list,
    lins: list[nn.Linear],
    orig: list[torch.Tensor],
    weights: Callable[[torch.Tensor], list[torch.Tensor]],
):
    """loss(s): mean squared error of submodule `inspect`'s output on the captured calls when
    the Linears hold weights(s) instead of `orig` (restored afterwards)."""
    ref = [ctx.run_call(inspect, c) for c in calls]  # outputs of the unquantized submodule, once
    numel = sum(r.numel() for r in ref)

    def loss(s: torch.Tensor) -> float:
        try:
            for lin, w, q in zip(lins, orig, weights(s)):
                lin.weight.copy_(q.to(w.dtype))
            err = sum(
                (ctx.run_call(inspect, c).float() - r.float()).pow(2).sum().item()
                for c, r in zip(calls, ref)
            )
        finally:
            for lin, w in zip(lins, orig):
                lin.weight.copy_(w)
        return err / numel

    return loss


def _linear_output_loss(
    calls: list, w: torch.Tensor, weight: Callable[[torch.Tensor], torch.Tensor]
):
    """loss(s) of a mapping whose inspected module is its one Linear (v_proj -> o_proj, up -> down).

    The output error of x W^T when W becomes W_q = weight(s) is |X (W_q - W)^T|^2 over the
    captured inputs X [T, K]: with F^T F = X^T X (F = R of a QR of X when T > K, else X itself),
    it is |F (W_q - W)^T|^2, so no candidate replays the module: N * K * min(T, K) multiply-adds
    per candidate instead of N * K * T (plus the reference output). The bias cancels.
    """
    x = torch.cat([c[0][0].reshape(-1, w.shape[1]) for c in calls]).float()  # [T, K]
    tokens, k = x.shape
    factor = x if tokens <= k else torch.linalg.qr(x, mode="r").R  # [min(T, K), K]
    numel = tokens * w.shape[0]

    def loss(s: torch.Tensor) -> float:
        d = weight(s).to(w.dtype).float() - w.float()  # [N, K], as the weight the module would hold
        return (d @ factor.T).pow(2).sum().item() / numel

    return loss


def _clamp(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """w [N, K] clamped to +-max_val [N, G] of its (row, group)."""
    lim = max_val.repeat_interleave(w.shape[1] // max_val.shape[1], dim=1)
    return torch.clamp(w, -lim, lim)


class _AbsMean:
    """Forward pre-hook accumulating mean |x| per input channel over every token."""

    def __init__(self):
        self.total: torch.Tensor | None = None  # [K] sum of |x| in fp32
        self.count = 0  # tokens seen

    def __call__(self, _module, inputs):
        x = inputs[0].detach().float()
        x = x.reshape(-1, x.shape[-1])
        part = x.abs().sum(dim=0)
        self.total = part if self.total is None else self.total + part
        self.count += x.shape[0]

    def value(self) -> torch.Tensor:
        assert self.total is not None, "the hooked Linear never ran during the replay"
        return self.total / self.count


def _sampler(out: list[torch.Tensor], step: int):
    """Forward pre-hook keeping every `step`-th input token [*, K] of each call."""

    def hook(_module, inputs):
        x = inputs[0].detach()
        out.append(x.reshape(-1, x.shape[-1])[::step])

    return hook


def _dense_rels(ctx: LayerContext) -> set[str]:
    """This layer's mixture-of-experts routers and shared-expert gates, relative names: they stay
    in full precision, so they are neither clipped nor fake-quantized (compress/moe.py)."""
    head = ctx.prefix + "."
    return {n[len(head) :] for n in dense_modules(ctx.state.model) if n.startswith(head)}


def _no_clip(rel: str) -> bool:
    leaf = rel.rsplit(".", 1)[-1].lower()
    return any(tag in leaf for tag in _NO_CLIP)
