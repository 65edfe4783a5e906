"""compressed-tensors' `targets` / `ignore` matching rule, as written in a config's config_groups.

An entry is an exact module name, `re:<regex>` (Python `re.match` on the full name), or a module
class name (`Linear` matches every `torch.nn.Linear`). The loader uses it to find the Linears a
config group quantizes; compress/targets.py uses it to select what a stage touches.
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
