"""The compute device a recipe names: `auto` (CUDA when available), `cpu`, `cuda`, `cuda:N`."""

from __future__ import annotations

import torch

from slimserve.compress.errors import RecipeError


def parse_device(name: str, field: str) -> torch.device | None:
    """`name` as a torch.device (None for `auto`), checked for syntax only; RecipeError names `field`."""
    if name == "auto":
        return None
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise RecipeError(f"{field}: {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise RecipeError(f"{field}: {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return dev


def resolve_device(name: str, field: str, auto: torch.device | None = None) -> torch.device:
    """The device to run on: `auto` is `auto` when given, else CUDA when available; a CUDA device
    that is not present is a RecipeError naming `field`."""
    dev = parse_device(name, field)
    if dev is None:
        return auto if auto is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError(f"{field}: {name!r} but no CUDA device is available; use auto or cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RecipeError(f"{field}: {name!r} but only {torch.cuda.device_count()} CUDA device(s) "
                              "exist; use cuda:0 .. cuda:N-1")
    return dev
