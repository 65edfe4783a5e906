"""Quantization arguments and schemes, with the named presets recipes refer to.

Field names follow compressed-tensors' `QuantizationArgs` (`num_bits`, `strategy`, ...) so the
exported `quantization_config` is a direct serialization and people who know llm-compressor
find their way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

QuantType = Literal["int", "float"]
Strategy = Literal["tensor", "channel", "group", "token"]
ActOrder = Literal["static", "group"]


class SchemeError(ValueError):
    """An impossible combination of quantization arguments (a user error)."""


@dataclass(frozen=True, slots=True)
class QuantArgs:
    num_bits: int  # bits per code: 2, 3, 4 or 8
    type: QuantType = "int"  # integer codes or float8 (e4m3)
    symmetric: bool = True  # True: zero point fixed at 0; False: a zero point per group
    strategy: Strategy = "group"  # one scale per tensor / output channel / group of inputs / token
    group_size: int | None = 128  # input columns per group (strategy 'group' only)
    dynamic: bool = False  # scales computed at run time (activations), not stored
    actorder: ActOrder | None = None  # GPTQ column order; 'group' writes g_idx

    def __post_init__(self) -> None:
        validate_args(self)

    @property
    def qmin(self) -> int:
        """Smallest signed code, -2^(b-1) (compressed-tensors convention)."""
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        """Largest signed code, 2^(b-1) - 1."""
        return 2 ** (self.num_bits - 1) - 1

    def with_(self, **changes) -> QuantArgs:
        return replace(self, **changes)

    def to_ct_dict(self) -> dict:
        """The compressed-tensors `QuantizationArgs` dict (only keys CT 0.12 knows)."""
        actorder = {"static": "weight", "group": "group", None: None}[self.actorder]
        return {
            "actorder": actorder,
            "block_structure": None,
            "dynamic": self.dynamic,
            "group_size": self.group_size if self.strategy == "group" else None,
            "num_bits": self.num_bits,
            "observer": None if self.dynamic else "minmax",
            "observer_kwargs": {},
            "strategy": self.strategy,
            "symmetric": self.symmetric,
            "type": self.type,
        }


def validate_args(a: QuantArgs) -> None:
    """Reject combinations that no kernel or format can express, naming the fix."""
    if a.type == "int" and a.num_bits not in (2, 3, 4, 8):
        raise SchemeError(f"num_bits={a.num_bits} is not supported for int; use 2, 3, 4 or 8")
    if a.type == "float" and a.num_bits != 8:
        raise SchemeError(f"float quantization is fp8 only; num_bits={a.num_bits} must be 8")
    if a.strategy == "group":
        if a.group_size is None or a.group_size <= 0 or a.group_size % 8:
            raise SchemeError(
                f"group_size={a.group_size} is invalid for strategy 'group'; use a positive "
                "multiple of 8 such as 32, 64 or 128 (or strategy 'channel')"
            )
    elif a.group_size not in (None, -1):
        raise SchemeError(
            f"group_size={a.group_size} only applies to strategy 'group', not '{a.strategy}'"
        )
    if a.strategy == "token" and not a.dynamic:
        raise SchemeError(
            "strategy 'token' needs dynamic: true (per-token scales exist only at run time)"
        )
    if a.actorder is not None and a.strategy != "group":
        raise SchemeError(f"actorder={a.actorder!r} needs strategy 'group'")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    weights: QuantArgs  # how Linear weights are quantized
    input_activations: QuantArgs | None = None  # None: activations stay in the model dtype

    @property
    def weight_only(self) -> bool:
        return self.input_activations is None

    def with_group_size(self, group_size: int | None) -> QuantScheme:
        """The same scheme with another group size (-1 or None means per output channel)."""
        if group_size in (None, -1):
            w = self.weights.with_(strategy="channel", group_size=None, actorder=None)
        else:
            w = self.weights.with_(strategy="group", group_size=group_size)
        return replace(self, weights=w)

    def ct_format(self) -> str:
        """The compressed-tensors `format` vLLM needs to pick a kernel for this scheme."""
        w = self.weights
        if self.weight_only and w.type == "int" and w.num_bits in (4, 8):
            return "pack-quantized"
        if self.input_activations is not None and w.type == "int":
            return "int-quantized"
        if self.input_activations is not None and w.type == "float":
            return "float-quantized"
        return "naive-quantized"


_W4 = QuantArgs(num_bits=4, symmetric=True, strategy="group", group_size=128)
PRESETS: dict[str, QuantScheme] = {
    "W4A16": QuantScheme(_W4),
    "W4A16_ASYM": QuantScheme(_W4.with_(symmetric=False)),
    "W3A16": QuantScheme(_W4.with_(num_bits=3)),
    "W8A16": QuantScheme(QuantArgs(num_bits=8, strategy="channel", group_size=None)),
    # int8 per-channel weights x dynamic per-token int8 activations (SmoothQuant's target).
    "W8A8": QuantScheme(
        QuantArgs(num_bits=8, strategy="channel", group_size=None),
        QuantArgs(num_bits=8, strategy="token", group_size=None, dynamic=True),
    ),
}


def preset(name: str) -> QuantScheme:
    """A named preset; an unknown name lists the known ones."""
    try:
        return PRESETS[name.upper()]
    except KeyError:
        raise SchemeError(f"unknown scheme {name!r}; known schemes: {', '.join(PRESETS)}") from None
