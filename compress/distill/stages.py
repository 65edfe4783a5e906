"""The `distill` stage: train the current (pruned) model towards a frozen teacher.

Teacher: the model as it was before the first `prune` stage (the pipeline keeps that copy on
the CPU), or a checkpoint named by `teacher`. Data: `dataset` (default: the recipe's calibration
dataset), always through its training split, never the evaluation split.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from slimserve.compress.datasets import load_token_documents, parse_dataset
from slimserve.compress.devices import resolve_device
from slimserve.compress.distill.loop import HiddenMap, TrainConfig, distill
from slimserve.compress.distill.losses import LossWeights
from slimserve.compress.errors import RecipeError
from slimserve.compress.progress import counting_bar
from slimserve.compress.stage import CompressionState, Stage, StageReport
from slimserve.runtime.loading.moe_experts import moe_layout

CURVE_POINTS = 200  # loss-curve records kept in the report (evenly spaced steps)


class DistillOptions(BaseModel):
    """Options of the `distill` stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    teacher: str | None = (
        None  # checkpoint path or hub id; None: the model before the first prune stage
    )
    dataset: str | None = None  # training data spec; None: the calibration dataset (train split)
    steps: int = Field(200, gt=0)  # optimizer steps
    batch_size: int = Field(8, gt=0)  # windows per step
    seq_len: int = Field(512, gt=1)  # tokens per window
    lr: float = Field(1e-4, gt=0)  # peak learning rate (AdamW); small models take more (demo: 5e-4)
    warmup_steps: int = Field(20, ge=0)  # linear warmup steps
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine floor as a fraction of lr
    weight_decay: float = Field(0.0, ge=0)  # AdamW weight decay
    max_grad_norm: float = Field(1.0, ge=0)  # gradient clipping; 0 disables it
    temperature: float = Field(1.0, gt=0)  # softmax temperature of the KL term
    kl_weight: float = Field(1.0, ge=0)  # weight of KL(teacher || student)
    ce_weight: float = Field(0.0, ge=0)  # weight of the data cross-entropy
    hidden_weight: float = Field(0.0, ge=0)  # weight of the hidden-state MSE on mapped layers
    hidden_layers: list[int] | None = None  # student layers matched by the hidden MSE; None: all
    # weight of a mixture-of-experts student's own load-balancing (aux) loss; 0: KL/CE/MSE only
    router_aux_weight: float = Field(0.0, ge=0)
    gradient_checkpointing: bool = False  # recompute activations in backward (saves memory)
    device: str = "auto"  # 'auto' (the recipe's device), 'cpu', 'cuda', 'cuda:1', ...
    # bf16 autocast of the forwards: 'auto' = on CUDA only; CPUs with AVX512-BF16/AMX gain too (docs/compressing.md)
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    seed: int = 0  # seed of the window sampler

    @model_validator(mode="after")
    def _some_loss(self):
        if self.kl_weight == self.ce_weight == self.hidden_weight == 0:
            raise ValueError(
                "kl_weight, ce_weight and hidden_weight are all 0; give one of them a weight"
            )
        return self

    def train_config(self, device: torch.device) -> TrainConfig:
        bf16 = self.precision == "bf16" or (self.precision == "auto" and device.type == "cuda")
        return TrainConfig(
            self.steps,
            self.batch_size,
            self.seq_len,
            self.lr,
            self.warmup_steps,
            self.min_lr_ratio,
            self.weight_decay,
            self.max_grad_norm,
            self.gradient_checkpointing,
            self.seed,
            bf16,
        )

    def loss_weights(self) -> LossWeights:
        return LossWeights(
            self.kl_weight,
            self.ce_weight,
            self.hidden_weight,
            self.temperature,
            self.router_aux_weight,
        )


class DistillStage(Stage):
    """Knowledge distillation of the current model from a frozen teacher (its own training windows,
    no calibration data)."""

    name = "distill"
    runs_before_quantization = True  # recipe check: no quantization stage before it

    def __init__(self, options: DistillOptions):
        self.options = options
        # Without its own `teacher`, it learns from the model before the first prune stage, so a
        # prune stage must come first (recipe check) and the pipeline keeps that copy.
        self.uses_teacher = options.teacher is None
        self.report = StageReport(self.name)
        self._teacher: nn.Module | None = None
        self._hidden: HiddenMap | None = None
        self._stream: torch.Tensor | None = None
        self._dataset = ""

    def prepare(self, state: CompressionState) -> None:
        if state.quantized:
            raise RecipeError(
                "stages: distill comes after a quantization stage, which it would undo; "
                "distill first, then quantize"
            )
        if self.options.router_aux_weight and moe_layout(state.model) is None:
            raise RecipeError(
                f"distill.router_aux_weight={self.options.router_aux_weight}: the model is not a "
                "mixture of experts (no router); set router_aux_weight: 0"
            )
        self._teacher = self._load_teacher(state)
        self._hidden = self._hidden_map(state) if self.options.hidden_weight else None
        spec = parse_dataset(
            self.options.dataset or state.calibration_dataset, state.base_dir
        ).for_calibration()
        self._dataset = str(spec)
        self._stream = load_token_documents(spec, state.tokenizer)  # [num_tokens]

    def _load_teacher(self, state: CompressionState) -> nn.Module:
        if self.options.teacher is None:
            if state.teacher is None:
                raise RecipeError(
                    "distill: no teacher; put a prune stage before it or set distill.teacher"
                )
            return state.teacher
        from slimserve.runtime.loading.loader import load_model

        path = Path(self.options.teacher).expanduser()
        if (
            not path.is_absolute()
            and state.base_dir is not None
            and (state.base_dir / path).exists()
        ):
            path = state.base_dir / path
        loaded = load_model(path if path.exists() else self.options.teacher, dtype=torch.float32)
        teacher = loaded.model.requires_grad_(False).eval()
        t_vocab, s_vocab = teacher.config.vocab_size, state.model.config.vocab_size
        if t_vocab != s_vocab:
            raise RecipeError(
                f"distill.teacher {self.options.teacher} has vocab {t_vocab}, the model "
                f"{s_vocab}; a teacher must share the student's tokenizer"
            )
        return teacher

    def _hidden_map(self, state: CompressionState) -> HiddenMap:
        n_student = state.model.config.num_hidden_layers
        tmap = state.teacher_map if self.options.teacher is None else None
        if tmap is None:
            t_cfg, s_cfg = self._teacher.config, state.model.config
            if (t_cfg.num_hidden_layers, t_cfg.hidden_size) != (n_student, s_cfg.hidden_size):
                raise RecipeError(
                    "distill.hidden_weight: the teacher's depth/width differ from the model's "
                    "and no prune stage maps them; use the prune stage's teacher or set "
                    "hidden_weight: 0"
                )
        chosen = tuple(self.options.hidden_layers or range(n_student))
        bad = [i for i in chosen if not 0 <= i < n_student]
        if bad:
            raise RecipeError(
                f"distill.hidden_layers: layer {bad[0]} does not exist; the model has "
                f"{n_student} layers (0..{n_student - 1})"
            )
        teacher_layers = tuple(tmap.layers[i] for i in chosen) if tmap else chosen
        channels = torch.tensor(tmap.hidden) if tmap and tmap.hidden is not None else None
        return HiddenMap(chosen, teacher_layers, channels)

    def apply(self, state: CompressionState) -> None:
        t0, cpu0 = time.perf_counter(), time.process_time()
        device = resolve_device(
            self.options.device, f"stages.{self.name}.device", auto=state.device
        )
        student, teacher = state.model, self._teacher
        student.to(device)
        teacher.to(device)
        try:
            history = self._train(student, teacher, device, state.progress)
        finally:
            student.to("cpu")
            teacher.to("cpu")
            student.eval()
        round_to_storage(student, state.storage_dtype)
        self.report.seconds = time.perf_counter() - t0
        self.report.details.update(
            describe_training(self.options, history, self._dataset, device, self._stream.numel())
        )
        # CPU seconds of this process (all threads): on a shared machine wall time overstates the cost
        self.report.details["cpu_seconds"] = time.process_time() - cpu0

    def _train(self, student, teacher, device, progress: bool) -> list[dict]:
        from rich.progress import TextColumn

        with counting_bar("distill", progress, TextColumn("loss {task.fields[loss]}")) as bar:
            task = bar.add_task("distill", total=self.options.steps, loss="—")

            def on_step(_step: int, record: dict) -> None:
                bar.update(task, advance=1, loss=f"{record['loss']:.4f}")

            return distill(
                student,
                teacher,
                self._stream,
                self.options.train_config(device),
                self.options.loss_weights(),
                self._hidden,
                device,
                on_step,
            )

    def finalize(self, state: CompressionState) -> StageReport:
        self._stream = None
        return self.report


@torch.no_grad()
def round_to_storage(model: nn.Module, storage: torch.dtype) -> None:
    """Round trained weights to the storage dtype (kept in the compute dtype), so the perplexity
    measured after this stage is the perplexity of what the artifact holds."""
    for p in model.parameters():
        p.copy_(p.to(storage).to(p.dtype))


def describe_training(
    opts: DistillOptions,
    history: list[dict],
    dataset: str,
    device: torch.device,
    stream_tokens: int,
) -> dict:
    """Report facts: the run's settings, first/last losses and a down-sampled loss curve."""
    n = len(history)
    every = max(1, -(-n // CURVE_POINTS))  # ceil(n / CURVE_POINTS)
    curve = [
        {k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()}
        for i, r in enumerate(history)
        if i % every == 0 or i == n - 1
    ]
    window = max(1, min(10, n // 5))  # smooth first/last over a few steps

    def mean_loss(rows):
        return sum(r["loss"] for r in rows) / len(rows)

    seconds = history[-1]["seconds"] if history else 0.0
    tokens = n * opts.batch_size * opts.seq_len
    return {
        "teacher": opts.teacher or "model before the first prune stage",
        "dataset": dataset,
        "dataset_tokens": stream_tokens,
        "device": str(device),
        "bf16": opts.train_config(device).bf16,
        "steps": opts.steps,
        "batch_size": opts.batch_size,
        "seq_len": opts.seq_len,
        "lr": opts.lr,
        "warmup_steps": opts.warmup_steps,
        "temperature": opts.temperature,
        "weights": {
            "kl": opts.kl_weight,
            "ce": opts.ce_weight,
            "hidden": opts.hidden_weight,
            "router_aux": opts.router_aux_weight,
        },
        "tokens_trained": tokens,
        "tokens_per_second": tokens / seconds if seconds else None,
        "loss_first": mean_loss(history[:window]) if history else None,
        "loss_last": mean_loss(history[-window:]) if history else None,
        "loss_curve": curve,
    }
