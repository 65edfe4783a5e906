"""Fake quantization of Linear inputs, so perplexity measures what a W8A8 kernel computes."""

from __future__ import annotations

from torch import nn

from slimserve.kernels.reference import fake_quantize_per_token_int8
from slimserve.runtime.artifact.scheme import QuantArgs

_HOOK_ATTR = "_slimserve_input_quant"


def attach_input_quant(linear: nn.Linear, args: QuantArgs) -> None:
    """Quantize the Linear's input per token (dynamic symmetric int8) on every forward; idempotent."""
    if not (
        args.type == "int" and args.num_bits == 8 and args.strategy == "token" and args.dynamic
    ):
        raise ValueError(
            f"input activations {args} are not supported; only dynamic per-token int8 is"
        )
    if getattr(linear, _HOOK_ATTR, None) is not None:
        return
    handle = linear.register_forward_pre_hook(
        lambda _m, inp: (fake_quantize_per_token_int8(inp[0]),) + inp[1:]
    )
    setattr(linear, _HOOK_ATTR, handle)


def detach_input_quant(linear: nn.Linear) -> None:
    handle = getattr(linear, _HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
        setattr(linear, _HOOK_ATTR, None)
