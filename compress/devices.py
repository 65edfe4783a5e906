"""The compute device a recipe names: `auto` (CUDA when available), `cpu`, `cuda`, `cuda:N`."""

from __future__ import annotations

import torch

from slimserve.compress.errors import RecipeError
from slimserve.runtime.devices import DeviceUnavailableError
from slimserve.runtime.devices import resolve_device as resolve_runtime_device


def parse_device(name: str, field: str) -> torch.device | None:
    """`name` as a torch.device (None for `auto`), checked for syntax only; RecipeError names `field`."""
    if name == "auto":
        return None
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise RecipeError(
            f"{field}: {name!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise RecipeError(f"{field}: {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return dev


def resolve_device(name: str, field: str, auto: torch.device | None = None) -> torch.device:
    """The device to run on (runtime.devices.resolve_device): `auto` is `auto` when given, else CUDA
    when available; a CUDA device that is not present is a RecipeError naming `field`."""
    explicit = parse_device(name, field) is not None
    try:
        dev = resolve_runtime_device(name, auto)
    except DeviceUnavailableError:
        raise RecipeError(
            f"{field}: {name!r} but no CUDA device is available; use auto or cpu"
        ) from None
    if (
        explicit
        and dev.type == "cuda"
        and dev.index is not None
        and dev.index >= torch.cuda.device_count()
    ):
        raise RecipeError(
            f"{field}: {name!r} but only {torch.cuda.device_count()} CUDA device(s) "
            "exist; use cuda:0 .. cuda:N-1"
        )
    return dev
