"""The contract between the pipeline and its stages.

A stage is a small stateful wrapper around a pure algorithm (docs/architecture.md, "The stage
contract"): it finds the modules it works on, hands their tensors to a function, and writes the
results back into the model and into `CompressionState`. The pipeline measures perplexity and
sizes around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantScheme

if TYPE_CHECKING:  # calibration imports this module
    from slimserve.compress.calibration import LayerContext


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
    details: dict[str, Any] = field(default_factory=dict)  # stage-specific facts (scheme, dims removed)
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
    hidden: tuple[int, ...] | None  # teacher hidden channels the student kept, ascending (None: all)


@dataclass(slots=True)
class CompressionState:
    model: nn.Module  # the HF causal LM being compressed, in the compute dtype
    tokenizer: Any  # its tokenizer
    storage_dtype: torch.dtype  # dtype of the exported tensors and of quantization scales
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # module name -> weight
    schemes: dict[str, QuantScheme] = field(default_factory=dict)  # module name -> full scheme (W8A8 acts)
    kv_scales: dict[str, tuple[float, float]] = field(default_factory=dict)  # attention module -> (k, v) fp8 scales
    kv_skip_layers: list[int] = field(default_factory=list)  # decoder layers whose KV stays unquantized
    calibration: torch.Tensor | None = None  # [num_samples, seq_len] token ids, when a stage needs them
    calibration_dataset: str = "stdlib"  # the recipe's calibration dataset spec (distill trains on it)
    calibration_dtype: str = "auto"  # dtype of layer replays (calibration.replay_dtype)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # calibration + eval device
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
            raise NotImplementedError(f"stage {self.name} is layerwise: calibration.run_layerwise drives it")
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
