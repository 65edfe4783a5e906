"""Which modules a stage touches: compressed-tensors' `targets` / `ignore` matching rules.

An entry is an exact module name, `re:<regex>` (Python `re.match` on the full name), or a module
class name (`Linear` matches every `torch.nn.Linear`).
"""

from __future__ import annotations

import re

from torch import nn


def matches(name: str, module: nn.Module, patterns: list[str] | tuple[str, ...]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name or p == type(module).__name__:
            return True
    return False


def select_linears(model: nn.Module, targets: list[str], ignore: list[str]) -> dict[str, nn.Linear]:
    """Linear modules matched by `targets` and not by `ignore`, in model order."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and matches(name, m, targets) and not matches(name, m, ignore)
    }


def check_patterns(model: nn.Module, patterns: list[str], what: str) -> None:
    """Refuse a `targets`/`ignore` entry that matches nothing (usually a typo)."""
    from slimserve.compress.errors import RecipeError

    modules = list(model.named_modules())
    for p in patterns:
        if not any(matches(n, m, [p]) for n, m in modules):
            raise RecipeError(
                f"{what}: {p!r} matches no module of this model; use a module name "
                "(e.g. lm_head), 're:<regex>' or a class name such as Linear"
            )
