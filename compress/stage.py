"""The contract between the pipeline and its stages.

A stage is a small stateful wrapper around a pure algorithm (design.md §4.1): it finds the
modules it works on, hands their tensors to a function, and writes the results back into the
model and into `CompressionState`. The pipeline measures perplexity and sizes around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

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
    calibration: torch.Tensor | None = None  # [num_samples, seq_len] token ids, when a stage needs them
    calibration_dataset: str = "stdlib"  # the recipe's calibration dataset spec (distill trains on it)
    calibration_dtype: str = "auto"  # dtype of layer replays (calibration.replay_dtype)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # calibration + eval device
    base_dir: Path | None = None  # folder relative dataset paths resolve against (the recipe's)
    progress: bool = True  # whether long stages (distill) show a progress bar
    teacher: nn.Module | None = None  # frozen copy of the model before the first prune stage (CPU)
    teacher_map: TeacherMap | None = None  # set by prune: student layers/channels -> teacher's


class Stage(Protocol):
    """What every registered stage provides.

    `needs_calibration`: the pipeline builds `state.calibration` before running it.
    `layerwise`: the stage runs decoder layer by decoder layer inside the calibration engine
    (whole-model stages such as `rtn` set it False and do all their work in `apply`).
    """

    name: str
    needs_calibration: bool
    layerwise: bool

    def prepare(self, state: CompressionState) -> None: ...

    def apply(self, state: CompressionState) -> None: ...

    def finalize(self, state: CompressionState) -> StageReport: ...
