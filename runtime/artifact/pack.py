"""Bit packing of integer codes into int32 words, in compressed-tensors' pack-quantized layout.

Dense packing (compressed-tensors >= 0.19): code `i` along the packed dimension occupies bits
`[i*b, (i+1)*b)` of a little-endian stream of 32-bit words, so for 3, 5, 6 and 7 bits a code may
straddle two words. The lowest index sits in the least-significant bits, a partial last word is
zero-padded and each word is reinterpreted as a signed int32. For 1, 2, 4 and 8 bits this is
bit-identical to the older CT `pack_to_int32` (whole codes per word).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASK32 = (1 << 32) - 1


def _check_bits(num_bits: int) -> None:
    if not 1 <= num_bits <= 8:
        raise ValueError(
            f"num_bits={num_bits} cannot be packed; pack-quantized holds 1 to 8 bits per code"
        )


def _bit_positions(size: int, num_bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Word index and bit offset of each of `size` codes in a dense little-endian bit stream."""
    start = torch.arange(size, dtype=torch.int64, device=device) * num_bits
    return start // 32, start % 32


def to_unsigned(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int32 offset-binary codes u = q + 2^(b-1) from signed codes q in [-2^(b-1), 2^(b-1))."""
    return codes.to(torch.int32) + (1 << (num_bits - 1))


def to_signed(unsigned_codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int8 signed codes q = u - 2^(b-1); the inverse of `to_unsigned`."""
    return (unsigned_codes.to(torch.int32) - (1 << (num_bits - 1))).to(torch.int8)


def pack_int32(unsigned_codes: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Pack a 2-D tensor of unsigned codes along `dim` into int32 words.

    unsigned_codes: integer [R, C] with values in [0, 2^b). Returns int32 [R, ceil(C*b/32)] for
    dim=1, or [ceil(R*b/32), C] for dim=0 (zero points are packed along the output rows).
    """
    _check_bits(num_bits)
    if unsigned_codes.dim() != 2 or dim not in (0, 1):
        raise ValueError(
            f"pack_int32 needs a 2-D tensor and dim 0 or 1, got shape "
            f"{tuple(unsigned_codes.shape)} and dim={dim}"
        )
    u = unsigned_codes.to(torch.int64)
    if u.numel() and (int(u.min()) < 0 or int(u.max()) >= 1 << num_bits):
        raise ValueError(
            f"codes must lie in [0, {(1 << num_bits) - 1}] for {num_bits} bits; "
            "convert signed codes with to_unsigned() first"
        )
    if dim == 0:
        u = u.t()
    rows, size = u.shape
    words = -(-size * num_bits // 32)
    word, off = _bit_positions(size, num_bits, u.device)
    packed = torch.zeros(rows, words + 1, dtype=torch.int64, device=u.device)
    # Bit fields never overlap, so adding is OR-ing; a code straddling a word boundary puts its
    # high bits at the bottom of the next word (extra column, dropped when it only holds padding).
    packed.scatter_add_(1, word.expand(rows, size), (u << off) & _MASK32)
    packed.scatter_add_(1, (word + 1).expand(rows, size), u >> (32 - off))
    packed = packed[:, :words]
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return (packed.t() if dim == 0 else packed).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 unsigned codes with `size` entries along `dim`.

    packed: int32 [R, W] (dim=1) or [W, C] (dim=0); padding beyond `size` is dropped.
    """
    _check_bits(num_bits)
    if packed.dim() != 2 or dim not in (0, 1):
        raise ValueError(
            f"unpack_int32 needs a 2-D tensor and dim 0 or 1, got shape "
            f"{tuple(packed.shape)} and dim={dim}"
        )
    p = packed.to(torch.int64) & _MASK32
    if dim == 0:
        p = p.t()
    rows, words = p.shape
    if size * num_bits > words * 32:
        raise ValueError(
            f"size={size} exceeds the {words * 32 // num_bits} codes that {words} words "
            f"of {num_bits}-bit codes hold"
        )
    word, off = _bit_positions(size, num_bits, p.device)
    p = F.pad(p, (0, 1))  # a zero word after the last, for codes that would straddle it
    lo = p[:, word] >> off
    hi = p[:, word + 1] << (
        32 - off
    )  # bits of a straddling code; shifted out of the mask otherwise
    u = ((lo | hi) & ((1 << num_bits) - 1)).to(torch.int32)
    return (u.t() if dim == 0 else u).contiguous()
