"""The contract between the pipeline and its stages.

A stage is a small stateful wrapper around a pure algorithm (docs/architecture.md, "The stage
contract"): it finds the modules it works on, hands their tensors to a function, and writes the
results back into the model and into `CompressionState`. The pipeline measures perplexity and
sizes around it.

What a layer hook receives is here too: `LayerContext` (one decoder layer on the compute
device, its cached inputs, `forward()` to replay them through it) and `replay`. The calibration
runner (compress/calibration.py) builds them; the stages only use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimserve.compress.mappings import ArchMapping
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantScheme


@dataclass(slots=True)
class ModuleReport:
    name: str  # module name, e.g. model.layers.0.mlp.down_proj
    error: float  # relative Frobenius error ||W - W_q|| / ||W|| of the weight
    bits: int  # weight bits after the stage


@dataclass(slots=True)
class StageReport:
    name: str  # stage name (registry key)
    seconds: float = 0.0  # wall time of the stage alone (no evaluation)
    modules: list[ModuleReport] = field(default_factory=list)  # per-module error, where it applies
    details: dict[str, Any] = field(
        default_factory=dict
    )  # stage-specific facts (scheme, dims removed)
    ppl: float | None = None  # perplexity after the stage (filled by the pipeline)
    size_bytes: int | None = None  # weight bytes after the stage (filled by the pipeline)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seconds": round(self.seconds, 3),
            "ppl": self.ppl,
            "size_bytes": self.size_bytes,
            "details": self.details,
            "modules": [{"name": m.name, "error": m.error, "bits": m.bits} for m in self.modules],
        }


@dataclass(frozen=True, slots=True)
class TeacherMap:
    """How the current (pruned) model lines up with the distillation teacher."""

    layers: tuple[int, ...]  # student decoder layer i continues teacher layer layers[i]
    hidden: (
        tuple[int, ...] | None
    )  # teacher hidden channels the student kept, ascending (None: all)


@dataclass(slots=True)
class CompressionState:
    model: nn.Module  # the HF causal LM being compressed, in the compute dtype
    tokenizer: Any  # its tokenizer
    storage_dtype: torch.dtype  # dtype of the exported tensors and of quantization scales
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # module name -> weight
    schemes: dict[str, QuantScheme] = field(
        default_factory=dict
    )  # module name -> full scheme (W8A8 acts)
    kv_scales: dict[str, tuple[float, float]] = field(
        default_factory=dict
    )  # attention module -> (k, v) fp8 scales
    kv_skip_layers: list[int] = field(
        default_factory=list
    )  # decoder layers whose KV stays unquantized
    kv_cache_dtype: str = ""  # "int8" / "int4": the online-quantized KV cache the artifact asks for
    calibration: torch.Tensor | None = (
        None  # [num_samples, seq_len] token ids, when a stage needs them
    )
    calibration_dataset: str = (
        "stdlib"  # the recipe's calibration dataset spec (distill trains on it)
    )
    calibration_dtype: str = "auto"  # dtype of layer replays (calibration.replay_dtype)
    device: torch.device = field(
        default_factory=lambda: torch.device("cpu")
    )  # calibration + eval device
    base_dir: Path | None = None  # folder relative dataset paths resolve against (the recipe's)
    progress: bool = True  # whether long stages (distill) show a progress bar
    teacher: nn.Module | None = None  # frozen copy of the model before the first prune stage (CPU)
    teacher_map: TeacherMap | None = None  # set by prune: student layers/channels -> teacher's


class Stage:
    """The contract between the pipeline and a stage: every capability and hook, with defaults.

    A stage class sets `name` and overrides the capabilities that differ from the defaults below
    (class attributes; a stage whose options decide one sets it on the instance in `__init__`).
    The registry builds it as `cls(options)`. The pipeline then runs, per stage:

        prepare(state)
        layerwise: calibration.run_layerwise(state, stage), which calls compress_layer(ctx) once
                   per decoder layer, in order (the only runner of layerwise stages)
        otherwise: apply(state)
        finalize(state) -> StageReport

    Before any model work, recipe.py and pipeline.py read the capabilities (order and teacher
    checks, calibration data) and call `preflight` and check `scheme` against the export format.
    """

    name: str
    """Registry key, e.g. 'gptq'; reports and error messages use it."""

    options: Any = None
    """The validated options model the stage was built from (registry.STAGES)."""

    report: StageReport
    """What `finalize` returns by default; a stage fills it while it runs."""

    needs_calibration: bool = False
    """The pipeline builds `state.calibration` (token windows) before running the stage."""

    layerwise: bool = False
    """The stage runs decoder layer by decoder layer inside the calibration engine
    (`compress_layer`); False: it does all its work on the whole model in `apply`."""

    replay_in_storage_dtype: bool = False
    """Layerwise stages that only collect input statistics (GPTQ's Hessians): with
    `calibration.dtype: auto` their layer replays run in the storage dtype (calibration.replay_dtype)."""

    calibrate_all_experts: bool = False
    """Layerwise stages on mixture-of-experts models: `compress_layer` runs with every expert on
    every calibration token, the layer's output still routed (compress/moe.py `all_experts`);
    gptq and awq set it from their `calibrate_all_experts` option (default true)."""

    runs_before_quantization: bool = False
    """The stage reshapes or retrains the weights (prune, distill): the recipe must put it before
    every stage without this flag."""

    snapshots_teacher: bool = False
    """The pipeline keeps a frozen copy of the model before the first such stage (prune) when a
    later stage `uses_teacher`; the stage records how its result maps onto it (state.teacher_map)."""

    uses_teacher: bool = False
    """The stage learns from that snapshot (distill without its own teacher checkpoint): the recipe
    must put a `snapshots_teacher` stage before it."""

    scheme: QuantScheme | None = None
    """The weight scheme the stage quantizes with (rtn, gptq) or prepares weights for (awq); None:
    it quantizes no weights. The pipeline refuses a scheme the export format cannot store, and a
    group size that does not divide the input width of a Linear it groups (`grouped_linears`),
    unless the recipe allows partial groups (compress/quant/group_sizes.py)."""

    handles_partial_groups: bool = True
    """With `export.allow_partial_groups`, the stage's algorithm copes with a last input group
    narrower than `group_size` (rtn, gptq); False: refused even then (awq, whose search compares
    whole groups)."""

    def preflight(self, config: Any) -> Any | None:
        """The model config this stage will leave (shapes only), given the one before it, or None
        when it leaves the shapes as they are (the default). Raises RecipeError for impossible
        targets, before any model work."""
        return None

    def grouped_linears(self, model: nn.Module) -> dict[str, nn.Linear]:
        """The Linears of `model` whose input columns this stage's `scheme` splits into groups
        (name -> module, model order); the pipeline checks their widths against the group size
        before any work, on a shape-only copy of the model each stage will see. Default: none."""
        return {}

    def prepare(self, state: CompressionState) -> None:
        """Check the model and options against `state` and set up; runs before the work."""

    def apply(self, state: CompressionState) -> None:
        """The work of a whole-model stage (`layerwise` False)."""
        if self.layerwise:
            raise NotImplementedError(
                f"stage {self.name} is layerwise: calibration.run_layerwise drives it"
            )
        raise NotImplementedError(f"stage {self.name} has no apply")

    def compress_layer(self, ctx: LayerContext) -> None:
        """The work of a layerwise stage on one decoder layer, called for layers 0, 1, ... in order.

        `ctx` (calibration.LayerContext) gives the layer on the compute device (`ctx.layer`,
        `ctx.module(rel)`), its index and module-name prefix, the architecture mapping, the
        pipeline state, the device and a per-layer scratch dict (`extra`). `ctx.forward()` replays
        the layer's cached calibration inputs through it (hooks the stage registered fire;
        `stop_after` ends each batch early), `ctx.capture_calls(rel)` records what a submodule is
        called with and `ctx.run_call(rel, call)` runs it alone on one such call. After this
        returns, the engine replays the compressed layer to make the next layer's inputs.
        """
        raise NotImplementedError(f"stage {self.name} has no compress_layer")

    def finalize(self, state: CompressionState) -> StageReport:
        """Finish (write back, restore, summarize) and return the stage's report."""
        return self.report


# -- what a layer hook receives (compress/calibration.py runs the layers) --------------------


class StopForward(Exception):
    """Raised by a hook so the model does not run past what a capture needs."""


@dataclass(slots=True)
class LayerInputs:
    hidden: list[torch.Tensor]  # per batch: [batch, seq_len, hidden] on the CPU
    kwargs: list[dict[str, Any]]  # per batch: keyword arguments of the layer call, on the CPU


@dataclass(slots=True)
class LayerContext:
    index: int  # decoder layer index
    prefix: str  # module name prefix, e.g. 'model.layers.3'
    layer: nn.Module  # the decoder layer, on `device`
    inputs: LayerInputs  # this layer's cached inputs (CPU)
    mapping: ArchMapping  # architecture mapping
    state: CompressionState  # pipeline state (quantized weights are recorded there)
    device: torch.device  # compute device
    extra: dict[str, Any] = field(default_factory=dict)  # per-layer scratch space for the stage
    # The layer's outputs on `inputs` (per batch, CPU), when the stage computed them with the
    # layer's final weights: run_layerwise then feeds them to the next layer without a replay.
    outputs: list[torch.Tensor] | None = None

    def forward(
        self, module: nn.Module | None = None, stop_after: list[nn.Module] | None = None
    ) -> list[torch.Tensor]:
        """Replay every cached batch through the layer (hooks fire); see `replay`."""
        return replay(module or self.layer, self.inputs, self.device, stop_after)

    def module(self, rel: str) -> nn.Module:
        return self.layer.get_submodule(rel)

    def capture_calls(
        self, rel: str, device: torch.device | None = None
    ) -> list[tuple[tuple, dict]]:
        """Replay the layer once; per batch, the (args, kwargs) submodule `rel` was called with.

        Kept on `device` (default CPU). Lets a stage run e.g. `self_attn` or `mlp` alone on
        the inputs it sees inside the layer (`run_call`). Other hooks fire during the replay.
        """
        calls: list[tuple[tuple, dict]] = []
        dev = device or torch.device("cpu")

        def hook(_m, args, kwargs):
            calls.append((to_device(args, dev), to_device(kwargs, dev)))

        handle = self.module(rel).register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.forward()
        finally:
            handle.remove()
        return calls

    def run_call(self, rel: str, call: tuple[tuple, dict]) -> torch.Tensor:
        """Submodule `rel` on one captured call; its (first) output, on the compute device."""
        args, kwargs = call
        with torch.no_grad():
            out = self.module(rel)(*to_device(args, self.device), **to_device(kwargs, self.device))
        return out[0] if isinstance(out, tuple) else out


def replay(
    module: nn.Module,
    inputs: LayerInputs,
    device: torch.device,
    stop_after: list[nn.Module] | None = None,
) -> list[torch.Tensor]:
    """Run every cached batch through `module` on `device`; its outputs, on the CPU.

    With `stop_after`, each batch stops as soon as every listed submodule has run (their own
    hooks, registered earlier, fire first) and nothing is returned: a stage that only needs the
    inputs of, say, q/k/v skips the rest of the layer.
    """
    outs: list[torch.Tensor] = []
    pending: set[int] = set()
    handles = []

    def stop_hook(mod, _args, _out):
        pending.discard(id(mod))
        if not pending:
            raise StopForward

    for sub in stop_after or ():
        handles.append(sub.register_forward_hook(stop_hook))
    try:
        with torch.no_grad():
            for h, kw in zip(inputs.hidden, inputs.kwargs):
                pending.update(id(sub) for sub in stop_after or ())
                try:
                    out = module(h.to(device), **to_device(kw, device))
                except StopForward:
                    continue
                if not stop_after:
                    outs.append((out[0] if isinstance(out, tuple) else out).cpu())
    finally:
        for handle in handles:
            handle.remove()
    return outs


def to_device(
    obj: Any, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> Any:
    """Tensors inside tuples/lists/dicts moved to `device`, floating ones cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(
            device=device, dtype=dtype if dtype is not None and obj.is_floating_point() else None
        )
    if isinstance(obj, tuple):
        return tuple(to_device(x, device, dtype) for x in obj)
    if isinstance(obj, list):
        return [to_device(x, device, dtype) for x in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device, dtype) for k, v in obj.items()}
    return obj
