"""`compress run`: recipe -> model -> baseline ppl -> stages (ppl after each) -> gate -> artifact + report.

The model is compressed in float32 (the compute dtype on CPU) while quantization scales and the
exported tensors use the storage dtype (the checkpoint's, unless the recipe says otherwise), so
the perplexity measured here is the perplexity of exactly what a loader reads back.

Which weights are in memory (`memory_plan`): when every stage is layerwise (gptq, awq,
smoothquant, kv_cache) and the model is a local safetensors checkpoint, only the trunk is held,
in the checkpoint's dtype, and each decoder layer is read, upcast to float32, worked on, spilled
and dropped in turn (compress/layer_store.py); perplexity then goes layer by layer and the
artifact is written layer by layer. A recipe with a whole-model stage (rtn, prune, distill) holds
the whole model in float32, as before. Both paths write the same tensors
(tests/compress/test_lazy_layers.py).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimserve.compress.calibration import run_layerwise
from slimserve.compress.datasets import calibration_batches, load_token_documents, parse_dataset
from slimserve.compress.devices import resolve_device
from slimserve.compress.errors import RecipeError, UnsupportedModelError
from slimserve.compress.export.formats import LIMITS, check_exportable, export_artifact
from slimserve.compress.export.io import ExportOptions, failed_output, replace_problem, size_bytes
from slimserve.compress.layer_store import LayerStore
from slimserve.compress.layerwise_eval import perplexity_on_device
from slimserve.compress.mappings import ARCHITECTURES
from slimserve.compress.model_size import count_parameters, weight_bytes
from slimserve.compress.moe import prepare_model
from slimserve.compress.progress import counting_bar
from slimserve.compress.quant.group_sizes import partial_group_modules, partial_groups, shape_model
from slimserve.compress.recipe import Recipe
from slimserve.compress.report import write_report
from slimserve.compress.stage import CompressionState, Stage, StageReport
from slimserve.compress.tasks.evaluate import TaskRun, evaluate_tasks, judge_task
from slimserve.runtime.artifact.manifest import (
    ArtifactManifest,
    hash_checkpoint,
    unverified_manifest,
    write_manifest,
)
from slimserve.runtime.dtypes import DTYPES, checkpoint_dtype
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.loading.gguf import gguf_file, resolve_model
from slimserve.runtime.loading.lazy_weights import available_memory
from slimserve.runtime.loading.loader import load_config, load_model, load_skeleton

COMPUTE_DTYPE = torch.float32
MEMORY_MODES = ("auto", "layers", "whole")  # run_recipe(memory=): see its docstring
SPILL_ENV = "SLIMSERVE_SPILL_DIR"  # where layer-by-layer runs keep their per-layer files (default: the temp dir)


@dataclass(frozen=True, slots=True)
class RunResult:
    artifact: Path  # the exported artifact folder (also holds report.json/.md/.png); when the
    # gate failed it is `<output>.failed`, beside the recipe's output, which is left untouched
    summary: dict  # the content of report.json
    passed: bool  # whether the perplexity gate passed


def run_recipe(
    recipe: Recipe, log: Callable[[str], None] = print, progress: bool = True, memory: str = "auto"
) -> RunResult:
    """Run every stage of `recipe`, gate on perplexity drift, export and report.

    The artifact goes to `recipe.output` when the gate passes (replacing an earlier artifact
    there), else to `<output>.failed`, so a failed run never replaces a passing artifact.

    memory: "auto" holds one decoder layer at a time when every stage is layerwise and the model
    is a local safetensors checkpoint (`memory_plan`), else the whole model in float32; "layers"
    requires the first (RecipeError naming why not), "whole" forces the second. Both write the
    same artifact.
    """
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory={memory!r}; use one of {', '.join(MEMORY_MODES)}")
    t_start = time.perf_counter()
    torch.manual_seed(0)
    device = resolve_device(
        recipe.device, "device"
    )  # before any work: an absent GPU is a recipe error
    check_output(recipe)  # before any work: never export over what is not an earlier artifact
    source = resolve_model(recipe.model, log)  # a GGUF checkpoint: its cached HF conversion
    config = load_config(source)
    stages = build_stages(recipe, config, log)  # shapes only: before any weight is read
    why_whole = (
        memory_plan(recipe, stages, source, config)
        if memory != "whole"
        else "memory='whole' was asked for"
    )
    if why_whole and memory == "layers":
        raise RecipeError(f"the model cannot be compressed layer by layer: {why_whole}")
    # the task gate's baseline: the source model on the serving engine, before anything loads
    tasks_before = _score_tasks(recipe, source, device, progress, log, "baseline")
    skeleton = None
    if not why_whole:
        try:
            skeleton = load_skeleton(source, ARCHITECTURES[config.model_type].layers)
        except ArtifactError as e:  # e.g. quantized, or tensor names only transformers renames
            if memory == "layers":
                raise
            why_whole = str(e)
    if skeleton is not None:
        model, tok = skeleton.model, skeleton.tokenizer
        log(
            f"memory: decoder layers are read from {source} one at a time (weights held in "
            f"{str(skeleton.dtype).removeprefix('torch.')}, each layer upcast to float32 while it is worked on)"
        )
    else:
        _warn_whole(source, config, why_whole, log)
        loaded = load_model(source, dtype=COMPUTE_DTYPE)
        if loaded.quantized:
            raise UnsupportedModelError(
                f"model {recipe.model} is already quantized; compress its unquantized base model instead"
            )
        model, tok = loaded.model, loaded.tokenizer
        prepare_model(model)  # stacked experts -> one Linear per expert (compress/moe.py)
    model.eval()
    storage = _storage_dtype(recipe, source)
    ev = recipe.eval
    eval_ids = load_token_documents(ev.dataset, tok, recipe.base_dir)

    def measure(label: str):
        res = perplexity_on_device(
            state.model,
            eval_ids,
            ev.seq_len,
            ev.max_windows,
            ev.batch_size,
            state.device,
            progress,
            note=lambda m: log(f"{label}: {m}"),
            layers=store,
        )
        log(f"{label}: ppl {res.ppl:.4f} over {res.tokens} tokens ({res.seconds:.1f}s)")
        return res

    state = CompressionState(
        model=model,
        tokenizer=tok,
        storage_dtype=storage,
        calibration_dataset=recipe.calibration.dataset,
        base_dir=recipe.base_dir,
        calibration_dtype=recipe.calibration.dtype,
        device=device,
        progress=progress,
    )
    store = (
        LayerStore(
            model,
            ARCHITECTURES[config.model_type],
            skeleton.checkpoint,
            state.quantized,
            spill_dir=os.environ.get(SPILL_ENV) or None,
        )
        if skeleton is not None
        else None
    )
    try:
        return _run(
            recipe, stages, state, store, measure, storage, source, t_start, log, tasks_before
        )
    finally:
        if store is not None:
            store.close()


def _run(
    recipe: Recipe,
    stages: list[Stage],
    state: CompressionState,
    store: LayerStore | None,
    measure,
    storage: torch.dtype,
    source: str,
    t_start: float,
    log: Callable[[str], None],
    tasks_before: TaskRun | None = None,
) -> RunResult:
    model, tok, ev = state.model, state.tokenizer, recipe.eval
    if state.device.type != "cpu":
        log(
            f"device: {state.device} (calibration replays layer by layer; evaluation holds the "
            f"{'whole model when it fits' if store is None else 'trunk and one layer'})"
        )
    baseline = measure("baseline")
    base_size, base_params = weight_bytes(model, {}, storage), count_parameters(model)
    if recipe.needs_calibration:
        cal = recipe.calibration
        state.calibration = calibration_batches(
            tok, parse_dataset(cal.dataset, recipe.base_dir), cal.num_samples, cal.seq_len, cal.seed
        )
    reports = _run_stages(recipe.stages, stages, state, measure, storage, store)
    model = state.model  # stages may have replaced it (prune rebuilds a smaller model)

    final_ppl = reports[-1].ppl
    increase = final_ppl / baseline.ppl - 1.0
    gate = {
        "max_ppl_increase": ev.max_ppl_increase,
        "ppl_increase": increase,
        "passed": increase <= ev.max_ppl_increase,
    }
    eval_info = {
        "dataset": ev.dataset,
        "seq_len": ev.seq_len,
        "tokens": baseline.tokens,
        "windows": baseline.windows,
        "baseline_ppl": baseline.ppl,
        "final_ppl": final_ppl,
        "gate": gate,
    }
    manifest = ArtifactManifest(
        base_model=recipe.model,
        base_model_sha256=hash_checkpoint(gguf_file(recipe.model) or source),
        recipe=recipe.text,
        stages=[r.to_dict() for r in reports],
        eval=eval_info,
        partial_groups=partial_group_modules(state.quantized),
        kv_cache_skip_layers=list(state.kv_skip_layers),
        kv_cache_dtype=state.kv_cache_dtype,
    )
    model.to(storage)
    model.config.dtype = storage  # config.json must name the dtype the tensors are stored in
    dest = recipe.output if gate["passed"] else failed_output(recipe.output)
    summary = {
        "model": recipe.model,
        "recipe": str(recipe.path) if recipe.path else None,
        "dataset": ev.dataset,
        "seq_len": ev.seq_len,
        "tokens": baseline.tokens,
        "baseline": {
            "ppl": baseline.ppl,
            "size_bytes": base_size,
            "seconds": baseline.seconds,
            "params": base_params,
        },
        "stages": [r.to_dict() for r in reports],
        "final": {"ppl": final_ppl, "size_bytes": 0, "params": count_parameters(model)},
        "gate": gate,
        "seconds": 0.0,
        "artifact": str(dest),
    }

    verdict = {"passed": True}

    def report(folder: Path) -> Path | None:  # into the finished temporary folder, before the move
        summary["final"]["size_bytes"] = size_bytes(folder)
        moved = None
        if tasks_before is not None:
            after = _score_tasks(recipe, str(folder), state.device, state.progress, log, "final")
            task_gate = judge_gate(recipe, tasks_before, after)
            verdict["passed"] = task_gate["passed"]
            summary["tasks"] = {
                "baseline": tasks_before.to_dict(),
                "final": after.to_dict(),
            }
            summary["task_gate"] = task_gate
            eval_info["task_gate"] = task_gate
            # the manifest records the task gate too: loaders refuse a failed one (check_gate)
            written = unverified_manifest(folder)
            write_manifest(folder, dataclasses.replace(written, eval=eval_info))
            if not task_gate["passed"]:
                log(f"task gate FAILED: {', '.join(task_gate['failed'])}")
                summary["artifact"] = str(failed_output(recipe.output))
                moved = failed_output(recipe.output)
        summary["seconds"] = time.perf_counter() - t_start
        write_report(folder, summary)
        return moved

    options = ExportOptions(
        model=model,
        tokenizer=tok,
        quantized=state.quantized,
        out_dir=dest,
        manifest=manifest,
        schemes=state.schemes,
        kv_scales=state.kv_scales,
        before_move=report,
    )
    artifact = export_artifact(recipe.export.format, options, layers=store)
    return RunResult(
        artifact=artifact, summary=summary, passed=gate["passed"] and verdict["passed"]
    )


def _score_tasks(
    recipe: Recipe,
    model: str,
    device: torch.device,
    progress: bool,
    log: Callable[[str], None],
    label: str,
) -> TaskRun | None:
    """The recipe's gated tasks scored on `model` by the serving engine (None without a task
    gate). The engine loads the artifact as `runtime serve` would, a failed perplexity gate
    allowed (the report still wants its tasks)."""
    gate = recipe.gate
    if not gate.tasks:
        return None
    log(f"{label}: tasks {', '.join(gate.tasks)} (first {gate.limit or 'all'} items each)")
    try:
        return evaluate_tasks(
            model,
            list(gate.tasks),
            gate.limit,
            progress=progress,
            note=lambda m: log(f"{label}: {m}"),
            device=str(device),
            allow_failed_gate=True,
        )
    except ArtifactError as e:
        raise RecipeError(f"gate.tasks: the serving engine cannot score this model: {e}") from None


def judge_gate(recipe: Recipe, before: TaskRun, after: TaskRun) -> dict:
    """The task gate's record: each task's paired comparison (compress/tasks/evaluate.py
    `judge_task`), which failed, and whether all passed."""
    gate = recipe.gate
    verdicts = {
        name: judge_task(
            before.tasks[name], after.tasks[name], spec.metric, spec.max_drop, gate.alpha
        )
        for name, spec in gate.tasks.items()
    }
    failed = [n for n, v in verdicts.items() if not v.passed]
    return {
        "passed": not failed,
        "failed": failed,
        "alpha": gate.alpha,
        "limit": gate.limit,
        "tasks": {n: v.to_dict() for n, v in verdicts.items()},
    }


def check_output(recipe: Recipe) -> None:
    """Refuse, before any work, an output that would delete what is not an earlier artifact: the
    model's own folder (or one inside or around it), or a non-empty folder without slimserve.json
    at the output or at `<output>.failed` (where a run whose gate fails writes)."""
    out = Path(recipe.output).resolve()
    model = Path(recipe.model).expanduser()
    if model.exists():
        model = model.resolve()
        where = (
            "is the model folder"
            if out == model
            else "is inside the model folder"
            if out.is_relative_to(model)
            else "contains the model folder"
            if model.is_relative_to(out)
            else None
        )
        if where:
            raise RecipeError(
                f"output: {out} {where} {model}; the export would replace it, so "
                "choose an output outside the model's folder"
            )
    for path in (out, failed_output(out)):
        problem = replace_problem(path)
        if problem:
            raise RecipeError(f"output: {problem}")


def build_stages(recipe: Recipe, config, log: Callable[[str], None] = print) -> list[Stage]:
    """The recipe's stage objects for a model with `config`, after refusing what cannot work
    before any work is done; logs a warning for the partial groups the recipe allows."""
    stages = [spec.build() for spec in recipe.stages]
    for stage in stages:  # a scheme the export format cannot store
        if stage.scheme is not None:
            check_exportable(recipe.export.format, stage.scheme, recipe.export.allow_partial_groups)
    _preflight(recipe, stages, config, log)
    return stages


def _preflight(recipe: Recipe, stages: list[Stage], config, log: Callable[[str], None]) -> None:
    """Refuse impossible shape targets before any work: each reshaping stage checks the config the
    stages before it leave (`preflight(config) -> config | None`), and each quantizing stage's group
    size must divide the input width of every Linear it groups in the model it will see
    (compress/quant/group_sizes.py), unless the recipe allows partial groups."""
    pruned_by, shapes = None, None  # the last reshaping stage; the meta model of `config`
    for i, (spec, stage) in enumerate(zip(recipe.stages, stages)):
        after = stage.preflight(config)
        if after is not None:
            config, pruned_by, shapes = after, spec.name, None
            continue
        if stage.scheme is None or stage.scheme.weights.strategy != "group":
            continue
        shapes = shapes if shapes is not None else shape_model(config)
        problem = partial_groups(stage.grouped_linears(shapes), stage.scheme)
        if problem is None:
            continue
        where = f"stages[{i}].{spec.name}.group_size: {problem.group_size} does not divide the input width of"
        if recipe.export.allow_partial_groups and stage.handles_partial_groups:
            log(
                f"warning: {where} {problem.modules()}; export.allow_partial_groups is set, so they get a "
                "partial last group, which only slimserve loads: vLLM and transformers (compressed-tensors) "
                "refuse this artifact"
            )
            continue
        prune = f", or set {pruned_by}.multiple_of: {problem.group_size}" if pruned_by else ""
        if not stage.handles_partial_groups:
            opt_in = f" ({spec.name} needs whole groups even with export.allow_partial_groups)"
        elif LIMITS[recipe.export.format].partial_groups:
            opt_in = (
                ", or set export.allow_partial_groups: true for an artifact only slimserve loads "
                "(vLLM and transformers refuse partial groups)"
            )
        else:
            opt_in = ""
        raise RecipeError(f"{where} {problem.modules()}; {problem.fix()}{prune}{opt_in}")


def _keeps_teacher(stages: list[Stage], i: int) -> bool:
    """Stage i is the first that snapshots the teacher, and a later stage distills from it."""
    return stages[i].snapshots_teacher and any(s.uses_teacher for s in stages[i + 1 :])


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy on the CPU in eval mode with gradients off: the distillation teacher."""
    teacher = copy.deepcopy(model).to("cpu").eval()
    return teacher.requires_grad_(False)


def _run_stages(
    specs,
    stages: list[Stage],
    state: CompressionState,
    measure,
    storage: torch.dtype,
    store: LayerStore | None = None,
) -> list[StageReport]:
    reports = []
    for i, (spec, stage) in enumerate(zip(specs, stages)):
        if _keeps_teacher(stages, i) and state.teacher is None:
            state.teacher = frozen_copy(state.model)
        reports.append(_run_stage(spec, stage, state, measure, storage, store))
    state.teacher = None  # free the copy before export
    return reports


def _run_stage(
    spec,
    stage: Stage,
    state: CompressionState,
    measure,
    storage: torch.dtype,
    store: LayerStore | None = None,
) -> StageReport:
    stage.prepare(state)
    if stage.layerwise:
        with _layer_bar(
            spec.name, state.model.config.num_hidden_layers, state.progress
        ) as on_layer:
            run_layerwise(state, stage, on_layer=on_layer, source=store)
    else:
        stage.apply(state)
    report = stage.finalize(state)
    if store is not None:
        store.finish()  # the layers the stage still holds (finalize may have changed them)
    report.ppl = measure(f"after {spec.name}").ppl
    report.size_bytes = weight_bytes(state.model, state.quantized, storage)
    return report


@contextmanager
def _layer_bar(name: str, layers: int | None, enabled: bool):
    """A progress bar over decoder layers for a layerwise stage; yields run_layerwise's on_layer."""
    with counting_bar(f"{name} layers", enabled) as bar:
        task = bar.add_task(name, total=layers)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def memory_plan(recipe: Recipe, stages: list[Stage], source: str, config) -> str:
    """Why the pipeline must hold the whole model in float32 ('' when it can hold one decoder layer
    at a time, compress/layer_store.py): a stage that works on the whole model (prune, distill,
    rtn), a model that is not a local folder, or an architecture compress/mappings.py lacks."""
    whole = [spec.name for spec, stage in zip(recipe.stages, stages) if not stage.layerwise]
    if whole:
        return f"stage {whole[0]} works on the whole model"
    if not Path(source).is_dir():
        return f"{source} is not a local checkpoint folder"
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"architecture {getattr(config, 'model_type', None)!r} has no layer mapping (compress/mappings.py)"
    return ""


def _warn_whole(source: str, config, why: str, log: Callable[[str], None]) -> None:
    """Say which path the run takes, loudly when the float32 model is larger than free memory."""
    params = _config_params(config)
    need, free = params * 4, available_memory()
    if free is not None and need > 0.9 * free:
        log(
            f"warning: the whole model is held in float32 ({why}): ~{need / 2**30:.1f} GiB against "
            f"{free / 2**30:.1f} GiB available; recipes whose stages are all layerwise (gptq, awq, "
            "smoothquant, kv_cache) hold one decoder layer at a time instead"
        )
    else:
        log(f"memory: the whole model is held in float32 ({why})")


def _config_params(config) -> int:
    """Parameters of the model `config` describes (counted on the meta device)."""
    try:
        return count_parameters(shape_model(config))
    except Exception:  # an architecture the shape model cannot build: no estimate, no warning
        return 0


def _storage_dtype(recipe: Recipe, source: str) -> torch.dtype:
    """The recipe's dtype, or the checkpoint's own (read from config.json, not the loaded copy)."""
    if recipe.dtype != "auto":
        return DTYPES[recipe.dtype]
    cfg_dtype = checkpoint_dtype(source)
    return cfg_dtype if cfg_dtype in DTYPES.values() else torch.bfloat16
