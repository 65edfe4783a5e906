"""Knowledge-distillation losses (pure functions of tensors).

kl_loss      T^2 * KL(teacher || student) of the token distributions at temperature T
             (Hinton et al. 2015: the T^2 keeps gradient magnitudes comparable across T)
ce_loss      next-token cross-entropy of the student on the data
hidden_loss  MSE between student and teacher hidden states of mapped layers, relative to the
             teacher's mean square (so its weight does not depend on the residual stream's scale)
router_aux   a mixture-of-experts student's own load-balancing loss (the architecture's
             `aux_loss` over its router logits, the term it was trained with), weighted
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class LossWeights:
    kl: float = 1.0  # weight of the KL term
    ce: float = 0.0  # weight of the cross-entropy on the data
    hidden: float = 0.0  # weight of the hidden-state MSE
    temperature: float = 1.0  # softmax temperature of the KL term
    router_aux: float = 0.0  # weight of a mixture-of-experts student's load-balancing loss


def kl_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """T^2 * mean over tokens of KL(softmax(teacher/T) || softmax(student/T)), in nats.

    Logits [..., V] (any leading shape, the same for both); computed in float32.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ; teacher and student must share the vocabulary"
        )
    t = temperature
    log_s = F.log_softmax(student_logits.float() / t, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(dim=-1)  # [...] per token
    return kl.mean() * (t * t)


def ce_loss(student_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (nats). student_logits [B, T, V], input_ids [B, T]; position t predicts t+1."""
    pred = student_logits[:, :-1].float()
    return F.cross_entropy(pred.reshape(-1, pred.size(-1)), input_ids[:, 1:].reshape(-1))


def hidden_loss(
    student: list[torch.Tensor], teacher: list[torch.Tensor], channels: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over pairs of ||s - t[..., channels]||^2 / ||t[..., channels]||^2 (per-element means).

    student[i] [B, T, H'] pairs with teacher[i] [B, T, H]; `channels` [H'] picks the teacher
    channels the student kept (None: H' == H, all of them).
    """
    if len(student) != len(teacher) or not student:
        raise ValueError(
            f"hidden_loss needs equally many student and teacher states (got "
            f"{len(student)} and {len(teacher)}, at least one)"
        )
    total = student[0].new_zeros((), dtype=torch.float32)
    for s, t in zip(student, teacher):
        t = t.float() if channels is None else t.float().index_select(-1, channels.to(t.device))
        total = total + (s.float() - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12)
    return total / len(student)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    input_ids: torch.Tensor,
    weights: LossWeights,
    student_hidden: list[torch.Tensor] | None = None,
    teacher_hidden: list[torch.Tensor] | None = None,
    channels: torch.Tensor | None = None,
    router_aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted sum of the enabled terms and each term's value (for logs and reports);
    `router_aux` is the student's load-balancing loss (needed when `weights.router_aux`)."""
    total = student_logits.new_zeros((), dtype=torch.float32)
    parts: dict[str, float] = {}
    if weights.kl:
        kl = kl_loss(student_logits, teacher_logits, weights.temperature)
        total = total + weights.kl * kl
        parts["kl"] = kl.item()
    if weights.ce:
        ce = ce_loss(student_logits, input_ids)
        total = total + weights.ce * ce
        parts["ce"] = ce.item()
    if weights.hidden:
        h = hidden_loss(student_hidden or [], teacher_hidden or [], channels)
        total = total + weights.hidden * h
        parts["hidden"] = h.item()
    if weights.router_aux:
        if router_aux is None:
            raise ValueError("weights.router_aux is set but the student returned no aux_loss")
        total = total + weights.router_aux * router_aux.float()
        parts["router_aux"] = router_aux.item()
    parts["loss"] = total.item()
    return total, parts
