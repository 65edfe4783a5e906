"""The `prune` stage: score heads / channels / layers (and, in a mixture of experts, experts and
their channels), keep the best, rebuild a smaller model.

The pipeline snapshots the teacher (the model before the first prune stage) when a `distill`
stage follows; this stage records how the pruned model maps onto it (`state.teacher_map`).
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from slimserve.compress.errors import RecipeError
from slimserve.compress.model_size import count_parameters
from slimserve.compress.prune.experts import describe_experts
from slimserve.compress.prune.importance import (
    ExpertScores,
    Importance,
    activation_importance,
    layer_perplexity_scores,
    magnitude_importance,
)
from slimserve.compress.prune.sizes import Dims, MoeDims, Targets, resolve_dims, resolve_moe
from slimserve.compress.prune.structured import PrunePlan, apply_plan, make_plan, resize_config
from slimserve.compress.stage import CompressionState, Stage, StageReport, TeacherMap

CALIBRATION_BATCH = 8  # calibration windows per forward pass while scoring
PLOT_POINTS = 128  # sorted-score samples per curve kept in the report (plots, not analysis)
MAX_LISTED = 2048  # removed channel indices are listed per layer up to this many


class PruneOptions(BaseModel):
    """Options of the `prune` stage. Amounts are removed; HF-named sizes are kept."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    heads: float | None = Field(None, ge=0, lt=1)  # fraction of attention heads removed
    mlp: float | None = Field(None, ge=0, lt=1)  # fraction of MLP channels removed
    hidden: float | None = Field(None, ge=0, lt=1)  # fraction of hidden channels removed
    layers: int | float | None = Field(
        None, ge=0
    )  # decoder layers removed: a count, or a fraction < 1
    num_attention_heads: int | None = Field(None, gt=0)  # query heads kept per layer
    num_key_value_heads: int | None = Field(None, gt=0)  # KV heads kept per layer
    intermediate_size: int | None = Field(None, gt=0)  # MLP channels kept per layer
    hidden_size: int | None = Field(None, gt=0)  # hidden channels kept
    num_layers: int | None = Field(None, gt=0)  # decoder layers kept
    heads_mode: Literal["query", "kv_groups"] = (
        "query"  # query heads evenly per group | whole KV groups
    )
    multiple_of: int = Field(64, gt=0)  # channel sizes stay multiples of this
    method: Literal["activation", "magnitude"] = (
        "activation"  # width importance: calibration or weights
    )
    layer_method: Literal["cosine", "perplexity"] = (
        "cosine"  # layer importance: 1 - cos(in, out) or ppl
    )
    # mixture-of-experts models (compress/prune/experts.py)
    experts: float | None = Field(None, ge=0, lt=1)  # fraction of experts removed per sparse layer
    num_experts: int | None = Field(None, gt=0)  # experts kept per sparse layer
    expert_mlp: float | None = Field(None, ge=0, lt=1)  # fraction of each expert's channels removed
    moe_intermediate_size: int | None = Field(None, gt=0)  # FFN channels kept per expert
    # which experts go: least routing weight (sum of top-k weights) or fewest routed tokens
    expert_method: Literal["weight", "frequency"] = "weight"

    @model_validator(mode="after")
    def _some_target(self):
        if all(getattr(self, k) is None for k in _TARGET_KEYS):
            raise ValueError(f"no pruning target; give at least one of {', '.join(_TARGET_KEYS)}")
        return self

    def targets(self) -> Targets:
        return Targets(
            **{k: getattr(self, k) for k in (*_TARGET_KEYS, "heads_mode", "multiple_of")}
        )

    @property
    def removes_layers(self) -> bool:
        return bool(self.layers) or self.num_layers is not None

    @property
    def removes_experts(self) -> bool:
        return bool(self.experts) or self.num_experts is not None

    @property
    def needs_calibration(self) -> bool:
        """Activation scores need data; so do layer and expert scores, whatever `method` is."""
        return self.method == "activation" or self.removes_layers or self.removes_experts


_TARGET_KEYS = (
    "heads",
    "mlp",
    "hidden",
    "layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "hidden_size",
    "num_layers",
    "experts",
    "num_experts",
    "expert_mlp",
    "moe_intermediate_size",
)


class PruneStage(Stage):
    """Structured, uniform-across-layers pruning of a Llama-family model or a mixture of experts."""

    name = "prune"
    snapshots_teacher = True  # the pipeline keeps a teacher copy before the first prune stage
    runs_before_quantization = True  # recipe check: no quantization stage before it

    def __init__(self, options: PruneOptions):
        self.options = options
        self.needs_calibration = options.needs_calibration  # activation or layer scores
        self.report = StageReport(
            self.name,
            details={
                "method": options.method,
                "layer_method": options.layer_method,
                "heads_mode": options.heads_mode,
                "multiple_of": options.multiple_of,
            },
        )
        self._after: Dims | None = None
        self._moe: tuple[MoeDims, MoeDims] | None = None  # sparse blocks before and after

    def _resolve(self, config) -> tuple[Dims, MoeDims | None, MoeDims | None]:
        """(dims after, sparse blocks before and after) for a model of `config`; RecipeError
        for an impossible target."""
        dims, targets = Dims.from_config(config), self.options.targets()
        moe = MoeDims.from_config(config)
        moe_after = resolve_moe(dims, moe, targets)  # refuses expert targets on a dense model
        return resolve_dims(dims, targets), moe, moe_after

    def preflight(self, config):
        """The config after this stage (shape only); RecipeError if the targets are impossible."""
        after, moe, moe_after = self._resolve(config)
        return resize_config(config, after, range(after.num_layers), moe, moe_after)

    def prepare(self, state: CompressionState) -> None:
        if state.quantized:
            raise RecipeError(
                "stages: prune comes after a quantization stage; prune first, then quantize"
            )
        self._after, moe, moe_after = self._resolve(state.model.config)
        self._moe = (moe, moe_after) if moe is not None else None
        if self.needs_calibration and state.calibration is None:
            raise RuntimeError("prune needs calibration data; the pipeline builds it first")

    def apply(self, state: CompressionState) -> None:
        t0 = time.perf_counter()
        model = state.model
        before = Dims.from_config(model.config)
        scores = self._scores(state, before)
        moe_before, moe_after = self._moe or (None, None)
        plan = make_plan(
            before,
            self._after,
            scores.heads,
            scores.channels,
            scores.hidden,
            scores.layers,
            scores.experts,
            moe_before,
            moe_after,
            self.options.expert_method,
        )
        params_before = count_parameters(model)
        state.model = apply_plan(model, plan)
        state.teacher_map = compose_teacher_map(state.teacher_map, plan)
        self.report.details.update(describe_plan(plan, scores))
        if moe_before is not None:
            kept = {lp.source: lp.experts for lp in plan.layers if lp.experts is not None}
            self.report.details["experts"] = describe_experts(
                moe_before, moe_after, scores.experts, kept, self.options.expert_method
            )
        self.report.details.update(
            params_before=params_before, params_after=count_parameters(state.model)
        )
        self.report.seconds = time.perf_counter() - t0

    def _scores(self, state: CompressionState, before: Dims) -> Importance:
        """Width scores by `method`; layer scores (only when layers go) by `layer_method`;
        expert scores (routing, measured whatever `method` is) when experts go."""
        opts = self.options
        batches = (
            list(state.calibration.split(CALIBRATION_BATCH))
            if state.calibration is not None
            else []
        )
        removes_layers = self._after.num_layers < before.num_layers
        cosine_layers = removes_layers and opts.layer_method == "cosine"
        moe_before, moe_after = self._moe or (None, None)
        removes_experts = moe_before is not None and moe_after.num_experts < moe_before.num_experts
        narrows_experts = (
            moe_before is not None and moe_after.intermediate_size < moe_before.intermediate_size
        )
        measured = (
            activation_importance(
                state.model,
                batches,
                every_expert=narrows_experts and opts.method == "activation",
            )
            if opts.method == "activation" or cosine_layers or removes_experts
            else None
        )
        scores = measured if opts.method == "activation" else magnitude_importance(state.model)
        if removes_layers:
            scores.layers = (
                measured.layers if cosine_layers else layer_perplexity_scores(state.model, batches)
            )
        if opts.method != "activation" and measured is not None and scores.experts is not None:
            scores.experts = [  # magnitude channels, measured routing
                None if m is None else _with_routing(m, r)
                for m, r in zip(scores.experts, measured.experts)
            ]
        return scores


def _with_routing(channels: ExpertScores, routing: ExpertScores) -> ExpertScores:
    return ExpertScores(
        channels.channels, routing.tokens, routing.counts, routing.weight, routing.prob
    )


def compose_teacher_map(prev: TeacherMap | None, plan: PrunePlan) -> TeacherMap:
    """The teacher map after `plan`, given the one before it (None: the model is the teacher)."""
    layers = tuple(lp.source if prev is None else prev.layers[lp.source] for lp in plan.layers)
    if prev is None or prev.hidden is None:
        hidden = plan.hidden if len(plan.hidden) < plan.before.hidden_size else None
    else:
        hidden = tuple(prev.hidden[j] for j in plan.hidden)
    return TeacherMap(layers, hidden)


def _curve(scores: torch.Tensor) -> list[float]:
    """Scores sorted descending, sampled at up to PLOT_POINTS evenly spaced ranks."""
    s = torch.sort(scores.float(), descending=True).values
    idx = torch.linspace(0, s.numel() - 1, min(PLOT_POINTS, s.numel())).round().long()
    return [round(float(v), 6) for v in s[idx]]


def _removed(total: int, kept: tuple[int, ...]) -> list[int]:
    keep = set(kept)
    return [i for i in range(total) if i not in keep]


def describe_plan(plan: PrunePlan, scores: Importance) -> dict:
    """Report facts: shapes, and per dimension what was kept, removed, and the scores."""
    b, a = plan.before, plan.after
    kept_layers = [lp.source for lp in plan.layers]
    heads, mlp = [], []
    for lp in plan.layers:
        heads.append(
            {
                "layer": lp.source,
                "kept": list(lp.q_heads),
                "removed": _removed(b.num_attention_heads, lp.q_heads),
                "kv_kept": list(lp.kv_heads),
                "scores": [round(float(x), 6) for x in scores.heads[lp.source]],
            }
        )
        if lp.experts is not None:
            continue  # a sparse layer: its experts are in details["experts"]
        removed = _removed(b.intermediate_size, lp.channels)
        mlp.append(
            {
                "layer": lp.source,
                "removed": removed if len(removed) <= MAX_LISTED else None,
                "sorted_scores": _curve(scores.channels[lp.source]),
            }
        )
    hidden_removed = _removed(b.hidden_size, plan.hidden)
    moe_b = plan.moe_before.to_dict() if plan.moe_before is not None else {}
    moe_a = plan.moe_after.to_dict() if plan.moe_after is not None else {}
    return {
        "dims_before": {**b.to_dict(), **moe_b},
        "dims_after": {**a.to_dict(), **moe_a},
        "importance": {
            "method": scores.method,
            "layers": {
                "kept": kept_layers,
                "removed": _removed(b.num_layers, tuple(kept_layers)),
                "scores": None
                if scores.layers is None
                else [round(float(x), 6) for x in scores.layers],
            },
            "heads": heads,
            "mlp": {"kept": a.intermediate_size, "of": b.intermediate_size, "per_layer": mlp},
            "hidden": {
                "kept": a.hidden_size,
                "of": b.hidden_size,
                "sorted_scores": _curve(scores.hidden),
                "removed": hidden_removed if len(hidden_removed) <= MAX_LISTED else None,
            },
        },
    }
