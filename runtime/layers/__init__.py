"""Runtime layers that execute compressed weights."""

from slimserve.runtime.layers.quant_linear import QuantLinear

__all__ = ["QuantLinear"]
