"""The distillation training loop: student learns the frozen teacher's token distributions.

Each step samples `batch_size` random windows of `seq_len` tokens from the training stream
(seeded), runs the teacher in eval mode without gradients, the student with gradients, and
takes one AdamW step on `distill_loss` with gradient clipping; the learning rate warms up
linearly and then follows a cosine down to `min_lr_ratio * lr`. With `bf16` both forwards run
under bf16 autocast (weights, optimizer state and the losses stay float32).

Mixture-of-experts models (runtime/loading/moe_experts.py `MOE_LAYOUTS`) are called with
`output_router_logits` set explicitly: off for the teacher, and on for the student only when the
load-balancing term is weighted (`LossWeights.router_aux`), so a config trained with it on (e.g.
the demo MoE, eval/demo_model.py) does not make every forward record router logits and compute
an aux loss nobody reads.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from slimserve.compress.distill.losses import LossWeights, distill_loss
from slimserve.compress.mappings import decoder_layers, mapping_for
from slimserve.runtime.loading.moe_experts import moe_layout


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 200  # optimizer steps
    batch_size: int = 8  # windows per step
    seq_len: int = 512  # tokens per window
    lr: float = 1e-4  # peak learning rate
    warmup_steps: int = 20  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    max_grad_norm: float = 1.0  # gradient clipping (L2 over all parameters); <= 0 disables it
    gradient_checkpointing: bool = False  # recompute layer activations in backward (less memory)
    seed: int = 0  # seed of the window sampler
    bf16: bool = False  # run both forwards under bf16 autocast (weights and optimizer stay float32)


@dataclass(frozen=True, slots=True)
class HiddenMap:
    """Which decoder layer outputs the hidden-state loss compares."""

    student_layers: tuple[int, ...]  # student decoder layers whose outputs are matched
    teacher_layers: tuple[int, ...]  # the teacher layer each one is matched to
    channels: (
        torch.Tensor | None
    )  # [H_student] teacher hidden channels the student kept (None: all)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to the floor."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sample_windows(
    stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    """`batch_size` random windows of a token stream [N]. -> [batch_size, seq_len] int64."""
    starts = torch.randint(0, stream.numel() - seq_len + 1, (batch_size,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


class _LayerOutputs:
    """Forward hooks keeping the output [B, T, H] of selected decoder layers, by layer index."""

    def __init__(self, layers: nn.ModuleList, indices: tuple[int, ...]):
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in indices]

    def _hook(self, i: int):
        def hook(_m, _args, out):
            # recompute overwrites: same value
            self.outputs[i] = out[0] if isinstance(out, tuple) else out

        return hook

    def take(self, indices: tuple[int, ...]) -> list[torch.Tensor]:
        return [self.outputs[i] for i in indices]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _checkpointing(model: nn.Module, on: bool) -> None:
    """Activation checkpointing on/off (transformers >= 5.x renamed gradient_checkpointing_*)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def router_kwargs(model: nn.Module, on: bool) -> dict:
    """The forward's `output_router_logits` for a mixture of experts ({} for a dense model)."""
    return {"output_router_logits": on} if moe_layout(model) is not None else {}


def distill(
    student: nn.Module,
    teacher: nn.Module,
    stream: torch.Tensor,
    cfg: TrainConfig,
    weights: LossWeights,
    hidden: HiddenMap | None = None,
    device: torch.device | str = "cpu",
    on_step: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """Train `student` in place towards `teacher` on windows of `stream` [N] token ids.

    Both models must be on `device`. Returns one record per step: step, lr, loss and its parts
    (kl, ce, hidden as enabled), seconds since the start.
    """
    if stream.numel() < cfg.seq_len:
        raise ValueError(
            f"the distillation data has {stream.numel()} tokens, fewer than seq_len="
            f"{cfg.seq_len}; use a larger dataset or a smaller seq_len"
        )
    device = torch.device(device)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    s_hooks = t_hooks = None
    if hidden is not None and weights.hidden:
        s_hooks = _LayerOutputs(
            decoder_layers(student, mapping_for(student)), hidden.student_layers
        )
        t_hooks = _LayerOutputs(
            decoder_layers(teacher, mapping_for(teacher)), hidden.teacher_layers
        )
    if cfg.gradient_checkpointing:
        _checkpointing(student, True)
    if weights.router_aux and moe_layout(student) is None:
        raise ValueError(
            "router_aux is weighted but the student is not a mixture of experts; set it to 0"
        )
    s_kwargs = router_kwargs(student, bool(weights.router_aux))
    t_kwargs = router_kwargs(teacher, False)
    was_training = student.training
    student.train()
    teacher.eval()
    history, t0 = [], time.perf_counter()
    try:
        for step in range(cfg.steps):
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            ids = sample_windows(stream, cfg.batch_size, cfg.seq_len, gen).to(device)  # [B, T]
            with torch.no_grad(), _autocast(device, cfg.bf16):
                t_logits = teacher(input_ids=ids, use_cache=False, **t_kwargs).logits
            with _autocast(device, cfg.bf16):
                s_out = student(input_ids=ids, use_cache=False, **s_kwargs)
            s_logits = s_out.logits  # [B, T, V]
            loss, parts = distill_loss(
                s_logits,
                t_logits,
                ids,
                weights,
                s_hooks.take(hidden.student_layers) if s_hooks else None,
                t_hooks.take(hidden.teacher_layers) if t_hooks else None,
                hidden.channels if hidden is not None else None,
                getattr(s_out, "aux_loss", None),
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                parts["grad_norm"] = float(
                    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                )
            opt.step()
            record = {"step": step, "lr": lr, **parts, "seconds": time.perf_counter() - t0}
            history.append(record)
            if on_step:
                on_step(step, record)
    finally:
        for hooks in (s_hooks, t_hooks):
            if hooks:
                hooks.remove()
        if cfg.gradient_checkpointing:
            _checkpointing(student, False)
        student.train(was_training)
    return history
