"""Distillation: the loss terms (values, gradients, temperature), the schedule and the loop."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from slimserve.compress.distill.loop import HiddenMap, TrainConfig, distill, lr_at, sample_windows
from slimserve.compress.distill.losses import (
    LossWeights,
    ce_loss,
    distill_loss,
    hidden_loss,
    kl_loss,
)

V = 50


def _logits(seed: int, shape=(2, 5, V), scale=3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_kl_is_zero_for_identical_models_and_positive_otherwise():
    t = _logits(0)
    assert kl_loss(t.clone(), t, temperature=1.0).abs() < 1e-6
    assert (
        kl_loss(t + 7.0, t, temperature=2.0).abs() < 1e-6
    )  # a constant shift is the same distribution
    assert kl_loss(_logits(1), t) > 0.1


def test_kl_matches_the_definition():
    s, t, T = _logits(1), _logits(2), 2.5
    p = F.softmax(t / T, -1)
    manual = (p * (p.log() - F.log_softmax(s / T, -1))).sum(-1).mean() * T * T
    torch.testing.assert_close(kl_loss(s, t, T), manual, rtol=1e-5, atol=1e-6)


def test_kl_gradient_points_from_student_to_teacher():
    """d/ds of T^2 KL(p_T || q_T) over N tokens is T (q_T - p_T) / N: a step against it lowers the KL."""
    s, t, T = _logits(1).requires_grad_(True), _logits(2), 2.0
    loss = kl_loss(s, t, T)
    loss.backward()
    n = s.shape[0] * s.shape[1]
    expected = T * (F.softmax(s.detach() / T, -1) - F.softmax(t / T, -1)) / n
    torch.testing.assert_close(s.grad, expected, rtol=1e-4, atol=1e-7)
    stepped = s.detach() - 0.5 * s.grad / s.grad.norm()
    assert kl_loss(stepped, t, T) < loss.detach()


def test_temperature_scaling():
    s, t = _logits(3), _logits(4)
    for T in (
        0.5,
        2.0,
        4.0,
    ):  # logits scaled by T at temperature T: the T=1 distributions, times T^2
        torch.testing.assert_close(
            kl_loss(s * T, t * T, T), kl_loss(s, t, 1.0) * T * T, rtol=1e-5, atol=1e-6
        )
    # higher temperature softens both distributions: the un-scaled KL shrinks
    raw = [kl_loss(s, t, T) / (T * T) for T in (1.0, 2.0, 4.0)]
    assert raw[0] > raw[1] > raw[2]


def test_kl_refuses_different_vocabularies():
    with pytest.raises(ValueError, match="share the vocabulary"):
        kl_loss(_logits(0, (1, 2, 10)), _logits(1, (1, 2, 11)))


def test_ce_loss_is_next_token_nll():
    logits, ids = (
        _logits(5),
        torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0)),
    )
    logp = F.log_softmax(logits, -1)
    manual = -torch.stack([logp[b, i, ids[b, i + 1]] for b in range(2) for i in range(4)]).mean()
    torch.testing.assert_close(ce_loss(logits, ids), manual)


def test_hidden_loss_is_relative_and_uses_kept_channels():
    t = torch.randn(2, 3, 8)
    idx = torch.tensor([1, 4, 6])
    assert hidden_loss([t[..., idx]], [t], idx) == 0
    s = t[..., idx] + 0.1
    ref = hidden_loss([s], [t], idx)
    torch.testing.assert_close(hidden_loss([s * 10], [t * 10], idx), ref)  # scale-free
    manual = (s - t[..., idx]).pow(2).mean() / t[..., idx].pow(2).mean()
    torch.testing.assert_close(ref, manual)
    with pytest.raises(ValueError, match="equally many"):
        hidden_loss([s], [t, t], idx)


def test_distill_loss_weights_and_parts():
    s, t = _logits(1), _logits(2)
    ids = torch.randint(0, V, (2, 5))
    total, parts = distill_loss(s, t, ids, LossWeights(kl=0.5, ce=2.0, temperature=2.0))
    torch.testing.assert_close(total, 0.5 * kl_loss(s, t, 2.0) + 2.0 * ce_loss(s, ids))
    assert set(parts) == {"kl", "ce", "loss"} and parts["loss"] == pytest.approx(total.item())


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(i, cfg) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine falls
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)
    assert lrs[55] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_sample_windows_are_slices_of_the_stream():
    stream = torch.arange(100)
    w = sample_windows(stream, 4, 10, torch.Generator().manual_seed(0))
    assert w.shape == (4, 10)
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 10)) for row in w)


def _pair():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    teacher = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    student = copy.deepcopy(teacher).requires_grad_(True)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return student, teacher


def test_distill_loop_moves_the_student_towards_the_teacher():
    student, teacher = _pair()
    frozen = {k: v.clone() for k, v in teacher.state_dict().items()}
    stream = torch.randint(0, V, (2000,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(steps=30, batch_size=4, seq_len=16, lr=3e-3, warmup_steps=3)
    ids = sample_windows(stream, 8, 16, torch.Generator().manual_seed(9))

    def kl_now():
        with torch.no_grad():
            return kl_loss(student(input_ids=ids).logits, teacher(input_ids=ids).logits).item()

    before = kl_now()
    seen = []
    history = distill(
        student, teacher, stream, cfg, LossWeights(), on_step=lambda i, r: seen.append(i)
    )
    assert kl_now() < 0.5 * before
    assert seen == list(range(30)) and [r["step"] for r in history] == seen
    assert history[0]["lr"] == pytest.approx(1e-3) and "grad_norm" in history[0]
    assert all(
        torch.equal(frozen[k], v) for k, v in teacher.state_dict().items()
    )  # teacher untouched
    assert all(p.grad is None for p in teacher.parameters())
    assert not student.training  # the caller's mode comes back


def test_hidden_term_and_gradient_checkpointing():
    student, teacher = _pair()
    stream = torch.randint(0, V, (500,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=8, lr=1e-3, warmup_steps=0)
    weights = LossWeights(kl=1.0, hidden=1.0)
    hidden = HiddenMap((0, 1), (0, 1), None)
    plain = distill(copy.deepcopy(student), teacher, stream, cfg, weights, hidden)
    ckpt = distill(
        copy.deepcopy(student),
        teacher,
        stream,
        replace(cfg, gradient_checkpointing=True),
        weights,
        hidden,
    )
    assert plain[0]["hidden"] > 0
    assert ckpt[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-5)


def test_distill_with_a_teacher_path_needs_no_prune_stage():
    from slimserve.compress.recipe import parse_recipe

    r = parse_recipe("model: m\noutput: o\nstages:\n  - distill: {teacher: big-model, steps: 2}\n")
    assert r.stages[0].config.teacher == "big-model" and not r.needs_calibration
