"""The compute device a name asks for: `auto` (CUDA when available), `cpu`, `cuda`, `cuda:N`."""

from __future__ import annotations

import torch


class DeviceUnavailableError(ValueError):
    """A CUDA device was asked for on a machine where none is visible."""


def resolve_device(name: str, auto: torch.device | None = None) -> torch.device:
    """The device to run on: `auto` is `auto` when given, else CUDA when available.

    A CUDA device with no CUDA visible raises DeviceUnavailableError in the runtime's wording
    (`--device`); callers whose users set another key (a recipe's) catch it and say their own.
    """
    if name == "auto":
        return (
            auto
            if auto is not None
            else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"device: {name!r} asked for but no CUDA device is visible; use --device cpu"
        )
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        count = torch.cuda.device_count()
        raise DeviceUnavailableError(
            f"device: {name!r} asked for but only {count} CUDA device"
            f"{'s are' if count != 1 else ' is'} visible; use cuda:0"
            f"{f' to cuda:{count - 1}' if count > 1 else ''}"
        )
    return device
