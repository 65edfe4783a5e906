"""A quantized Linear weight in unpacked form: the in-memory side of the artifact contract.

Codes are signed (int4 runs -8..7) with a per-(row, group) scale in the storage dtype and, when
asymmetric, a signed int8 zero point: compressed-tensors' conventions. The codecs in this package
(compressed_tensors.py, gptq_format.py, awq_format.py) pack it for disk; compress/quant/ produces it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimserve.runtime.artifact.scheme import QuantArgs


@dataclass(slots=True)
class QuantizedWeight:
    """A quantized Linear weight in unpacked form; export packs it for the chosen format."""

    codes: torch.Tensor  # int8 [N, K] signed codes in [qmin, qmax]
    scale: torch.Tensor  # [N, G] in the storage dtype (G groups; 1 for channel)
    zero_point: torch.Tensor | None  # int8 [N, G] signed zero points; None when symmetric
    g_idx: torch.Tensor | None  # int32 [K] group of each input column; None means k // group_size
    args: QuantArgs  # how it was quantized

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def group_index(self) -> torch.Tensor:
        """int64 [K]: the group each input column reads its scale from."""
        return group_index(self.codes.shape[1], self.args, self.g_idx)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N, K] weight (q - zp) * scale, computed in fp32 and cast once to `dtype`."""
        w = dequantize(self.codes, self.scale, self.zero_point, self.group_index())
        return w.to(dtype or self.scale.dtype)


def group_index(k: int, args: QuantArgs, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [K] group of each input column: g_idx if given, k // group_size, or all 0."""
    if g_idx is not None:
        return g_idx.long()
    if args.strategy == "group":
        return torch.arange(k) // args.group_size
    return torch.zeros(k, dtype=torch.long)


def num_groups(k: int, args: QuantArgs) -> int:
    return -(-k // args.group_size) if args.strategy == "group" else 1


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, gidx: torch.Tensor
) -> torch.Tensor:
    """fp32 [N, K] = (codes - zp) * scale, scales gathered per input column by gidx [K]."""
    q = codes.float()
    if zero_point is not None:
        q = q - zero_point.float()[:, gidx]
    return q * scale.float()[:, gidx]
