"""Recipes: the YAML a user writes, validated completely before any model is loaded.

pydantic lives only here, at the edge. Every problem is reported with its path in the YAML and,
for a misspelt key, the closest valid one: `stages[0].rtn.bitz: unknown key; did you mean 'bits'?`
Relative paths (model, output, dataset files) resolve against the recipe file's folder.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slimserve.compress.devices import parse_device
from slimserve.compress.errors import RecipeError
from slimserve.compress.registry import STAGE_SPECS, STAGES
from slimserve.compress.stage import Stage
from slimserve.compress.tasks.catalog import parse_tasks, task_metrics
from slimserve.compress.tasks.data import TaskDataError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationSpec(_Strict):
    dataset: str = "stdlib"  # dataset spec (stdlib uses its train split for calibration)
    num_samples: int = Field(64, gt=0)  # number of calibration sequences
    seq_len: int = Field(512, gt=1)  # tokens per calibration sequence
    seed: int = 0  # seed of the window sampler
    # dtype layer replays run in; auto: the checkpoint's for statistics-only stages (GPTQ)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class EvalSpec(_Strict):
    dataset: str = "stdlib"  # dataset spec for perplexity (stdlib: validation split)
    seq_len: int = Field(512, gt=1)  # tokens per window
    max_windows: int | None = Field(None, gt=0)  # None: every window of the split
    max_ppl_increase: float = Field(0.10, ge=0)  # gate: final/baseline - 1 must not exceed this
    batch_size: int = Field(8, gt=0)  # windows per forward pass


class TaskGateSpec(_Strict):
    max_drop: float = Field(1.0, ge=0)  # accuracy points the task may lose (1.0 = one point)
    metric: Literal["acc", "acc_norm"] = "acc"  # which accuracy is judged


class GateSpec(_Strict):
    # task -> its allowance: the task fails when its accuracy drops by more than max_drop points
    # and the paired test on the same items finds the drop significant (compress/tasks/evaluate.py)
    tasks: dict[str, TaskGateSpec] = {}
    limit: int | None = Field(None, gt=0)  # the first N items of each task (None: all)
    alpha: float = Field(0.05, gt=0, lt=1)  # significance level of the paired test (McNemar)


class ExportSpec(_Strict):
    format: Literal["compressed-tensors", "gptq", "awq"] = (
        "compressed-tensors"  # on-disk format of the artifact
    )
    # true: a group size that does not divide some Linear's in_features is quantized with a partial
    # last group instead of being refused; only slimserve loads such an artifact (vLLM and
    # transformers refuse it), compressed-tensors only, listed in the manifest (compress/quant/group_sizes.py)
    allow_partial_groups: bool = False


class RecipeModel(_Strict):
    model: str  # HF model id or a path (relative to the recipe file)
    output: str  # artifact folder (relative to the recipe file)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = (
        "auto"  # storage dtype of the artifact
    )
    device: str = (
        "auto"  # calibration replays and perplexity: auto (cuda when available), cpu, cuda:N
    )
    calibration: CalibrationSpec = CalibrationSpec()
    eval: EvalSpec = EvalSpec()
    gate: GateSpec = GateSpec()
    stages: list[dict[str, Any]] = Field(min_length=1)
    export: ExportSpec = ExportSpec()


@dataclass(frozen=True, slots=True)
class StageSpec:
    name: str  # registry key, e.g. 'rtn'
    config: BaseModel  # the stage's validated options

    def build(self) -> Stage:
        """A new stage object for these options (cheap: no model is needed)."""
        return STAGES[self.name][1](self.config)


@dataclass(frozen=True, slots=True)
class Recipe:
    path: Path | None  # the recipe file (None when built in code)
    text: str  # the YAML verbatim (stored in the artifact manifest)
    model: str  # resolved model path, or the HF id when no such local path exists
    output: Path  # resolved artifact folder
    dtype: str  # storage dtype: auto (the checkpoint's) or an explicit one
    device: str  # compute device of calibration and evaluation (compress/devices.py)
    calibration: CalibrationSpec
    eval: EvalSpec
    stages: tuple[StageSpec, ...]
    export: ExportSpec
    gate: GateSpec = GateSpec()

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path.cwd()

    @property
    def needs_calibration(self) -> bool:
        """Whether any stage needs the calibration windows."""
        return any(s.build().needs_calibration for s in self.stages)


def load_recipe(path: str | Path, output: str | Path | None = None) -> Recipe:
    """Read and validate a recipe file; `output` overrides the recipe's `output`."""
    p = Path(path)
    if not p.is_file():
        raise RecipeError(
            f"recipe file not found: {p}; pass the path of a .yaml recipe (see recipes/)"
        )
    return parse_recipe(p.read_text(encoding="utf-8"), p, output)


def parse_recipe(text: str, path: Path | None = None, output: str | Path | None = None) -> Recipe:
    where = str(path) if path else "recipe"
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise RecipeError(
            f"{where}{line}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax"
        ) from None
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{where}: a recipe is a YAML mapping with keys model, output, stages, ..."
        )
    top = _validate(RecipeModel, raw, "")
    parse_device(top.device, "device")
    stages = tuple(_parse_stage(i, s) for i, s in enumerate(top.stages))
    _check_order(stages)
    _check_gate(top.gate)
    base = path.parent if path else Path.cwd()
    return Recipe(
        path=path,
        text=text,
        model=_resolve_model(top.model, base),
        output=(Path(output) if output is not None else base / top.output).resolve(),
        dtype=top.dtype,
        device=top.device,
        calibration=top.calibration,
        eval=top.eval,
        stages=stages,
        export=top.export,
        gate=top.gate,
    )


def _resolve_model(model: str, base: Path) -> str:
    """A local folder relative to the recipe wins; otherwise the string is a hub id."""
    local = (base / model).expanduser()
    if local.exists():
        return str(local.resolve())
    if model.startswith((".", "/", "~")):
        raise RecipeError(
            f"model: folder {local} does not exist; fix the path (relative to the recipe file)"
        )
    return model


def _parse_stage(i: int, entry: Any) -> StageSpec:
    names = ", ".join(STAGE_SPECS)
    if not isinstance(entry, dict) or len(entry) != 1:
        raise RecipeError(
            f"stages[{i}]: each stage is a mapping with one key, the stage name ({names})"
        )
    ((name, options),) = entry.items()
    if name not in STAGE_SPECS:
        hint = difflib.get_close_matches(str(name), list(STAGE_SPECS), n=1)
        tip = f"did you mean '{hint[0]}'? " if hint else ""
        raise RecipeError(f"stages[{i}].{name}: unknown stage; {tip}available stages: {names}")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise RecipeError(f"stages[{i}].{name}: options must be a mapping, got {options!r}")
    return StageSpec(name, _validate(STAGE_SPECS[name], options, f"stages[{i}].{name}"))


def _check_order(stages: tuple[StageSpec, ...]) -> None:
    """Stages that reshape or retrain the model (prune, distill) come before every quantization
    stage; one that distills from the pre-pruning model needs a prune stage before it."""
    built = [spec.build() for spec in stages]
    for i, (spec, stage) in enumerate(zip(stages, built)):
        if stage.runs_before_quantization:
            later = next(
                (s for s, b in zip(stages[:i], built) if not b.runs_before_quantization), None
            )
            if later is not None:
                raise RecipeError(
                    f"stages[{i}].{spec.name} comes after {later.name}; {spec.name} changes the "
                    f"weights, so move it before the quantization stages"
                )
        if stage.uses_teacher and not any(b.snapshots_teacher for b in built[:i]):
            raise RecipeError(
                f"stages[{i}].{spec.name}: no teacher; the teacher is the model before "
                f"the first prune stage, so put a prune stage before it or set "
                f"stages[{i}].{spec.name}.teacher to a checkpoint"
            )


def _check_gate(gate: GateSpec) -> None:
    """Every gated task exists and reports the metric its gate judges."""
    for name, spec in gate.tasks.items():
        try:
            (task,) = parse_tasks(name)
        except TaskDataError as e:
            raise RecipeError(f"gate.tasks.{name}: {e}") from None
        if task != name:
            raise RecipeError(f"gate.tasks.{name}: name one task per key")
        metrics = task_metrics(name)
        if spec.metric not in metrics:
            raise RecipeError(
                f"gate.tasks.{name}.metric: {name} reports {', '.join(metrics)}, not {spec.metric}"
            )


def _validate(cls: type[BaseModel], data: dict, prefix: str) -> BaseModel:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) if isinstance(x, str) else f"[{x}]" for x in err["loc"]]
        path = ".".join(x for x in [prefix, ".".join(loc).replace(".[", "[")] if x)
        raise RecipeError(f"{path}: {_describe(cls, err)}") from None


def _describe(cls: type[BaseModel], err: dict) -> str:
    if err["type"] == "extra_forbidden":
        fields = _fields_at(cls, err["loc"][:-1])
        hint = difflib.get_close_matches(str(err["loc"][-1]), fields, n=1, cutoff=0.5)
        tip = f"did you mean '{hint[0]}'?" if hint else f"valid keys: {', '.join(fields)}"
        return f"unknown key; {tip}"
    if err["type"] == "missing":
        return "required key is missing"
    if err["type"] == "value_error":
        return err["msg"].removeprefix("Value error, ")
    return f"{err['msg']} (got {err.get('input')!r})"


def _fields_at(cls: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model reached by following `loc` from `cls`."""
    for key in loc:
        if not isinstance(key, str) or key not in cls.model_fields:
            continue
        ann = cls.model_fields[key].annotation
        candidates = typing.get_args(ann) if isinstance(ann, types.UnionType) else (ann,)
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if nested:
            cls = nested[0]
    return list(cls.model_fields)
