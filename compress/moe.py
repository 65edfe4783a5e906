"""Mixture-of-experts models in compression: per-expert Linears, their routers kept dense, and
calibration that reaches every expert.

The model's stacked experts become one nn.Linear per expert under the checkpoints' names when it
loads (runtime/loading/moe_experts.py `unfuse_experts`: `load_skeleton` does it for layer-by-layer
runs, `prepare_model` here for the whole model), so every Linear-based stage sees them. The
routers (and Qwen2-MoE's `shared_expert_gate`) are never quantized: target selection leaves them
out (compress/targets.py `select_linears`) and the export lists them in the artifact's `ignore`
(compress/export/io.py `linear_classes`).

Calibration: a router sends each token to k of E experts, so on a few calibration windows some
experts see few tokens or none, and their GPTQ Hessian or AWQ statistics are empty. A stage with
`calibrate_all_experts` (the default of gptq and awq) runs `compress_layer` inside
`all_experts(layer)`: every expert runs on every calibration token, so its Linears' hooks see them
all, while the layer's output still takes each token from its routed experts only
(`ExpertList.calibrate_all`). What each expert saw is in the stage's report (`expert_tokens`),
with a note naming each expert that saw fewer than `MIN_EXPERT_TOKENS` tokens.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

from torch import nn

from slimserve.runtime.loading.moe_experts import ExpertList, dense_moe_modules, unfuse_experts

MIN_EXPERT_TOKENS = 16  # an expert whose statistics saw fewer calibration tokens is named in a note
_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.[^.]+$")  # '<block>.experts.<e>.<linear>'


def prepare_model(model: nn.Module) -> int:
    """Give a loaded model's sparse blocks one Linear per expert (in place); blocks converted."""
    return unfuse_experts(model)


def dense_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that stay in full precision whatever the targets: routers, shared-expert gates."""
    return dense_moe_modules(model)


@contextmanager
def all_experts(layer: nn.Module, enabled: bool = True):
    """Within the block every expert of `layer` runs on every token (outputs still routed)."""
    lists = [m for m in layer.modules() if isinstance(m, ExpertList)] if enabled else []
    for m in lists:
        m.calibrate_all = True
    try:
        yield
    finally:
        for m in lists:
            m.calibrate_all = False


def expert_of(name: str) -> str | None:
    """The expert module a Linear name belongs to ('...mlp.experts.3'), or None."""
    hit = _EXPERT.match(name)
    return hit.group(1) if hit else None


def expert_tokens(tokens: dict[str, int]) -> dict[str, int]:
    """Per expert module, the fewest calibration tokens any of its Linears' statistics saw, from
    `tokens` (Linear name -> tokens); Linears outside experts are left out."""
    out: dict[str, int] = {}
    for name, n in tokens.items():
        expert = expert_of(name)
        if expert is not None:
            out[expert] = min(out.get(expert, n), n)
    return out


def starved_notes(per_expert: dict[str, int], stage: str, all_on: bool) -> list[str]:
    """One note per expert that saw fewer than MIN_EXPERT_TOKENS tokens."""
    hint = (
        ""
        if all_on
        else f" (set stages.{stage}.calibrate_all_experts: true to calibrate every expert on every token)"
    )
    return [
        f"{name} saw {n} calibration tokens (fewer than {MIN_EXPERT_TOKENS}): its statistics "
        f"are thin or empty{hint}"
        for name, n in per_expert.items()
        if n < MIN_EXPERT_TOKENS
    ]
