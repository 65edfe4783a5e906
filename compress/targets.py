"""Which modules a stage touches, by compressed-tensors' `targets` / `ignore` rules (the matching
itself is the artifact's: runtime/artifact/targets.py), and the refusal of an entry that matches
nothing."""

from __future__ import annotations

from torch import nn

from slimserve.compress.errors import RecipeError
from slimserve.runtime.artifact.targets import matches


def select_linears(model: nn.Module, targets: list[str], ignore: list[str]) -> dict[str, nn.Linear]:
    """Linear modules matched by `targets` and not by `ignore`, in model order."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and matches(name, m, targets) and not matches(name, m, ignore)
    }


def check_patterns(model: nn.Module, patterns: list[str], what: str) -> None:
    """Refuse a `targets`/`ignore` entry that matches nothing (usually a typo)."""
    modules = list(model.named_modules())
    for p in patterns:
        if not any(matches(n, m, [p]) for n, m in modules):
            raise RecipeError(
                f"{what}: {p!r} matches no module of this model; use a module name "
                "(e.g. lm_head), 're:<regex>' or a class name such as Linear"
            )
