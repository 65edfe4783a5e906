"""Bit packing of integer codes into int32 words, in compressed-tensors' pack-quantized layout.

Element `i` along the packed dimension goes to word `i // (32 // b)`, bits
`b * (i % (32 // b))` upwards: the lowest index sits in the least-significant bits. A partial
last word is zero-padded and the word is reinterpreted as a signed int32. For 4 and 8 bits this
is bit-identical to both the older CT `pack_to_int32` and the newer "dense" packing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASK32 = (1 << 32) - 1


def _check_bits(num_bits: int) -> int:
    """Codes per int32 word; only widths that tile a word exactly (1, 2, 4, 8) are packable."""
    if num_bits not in (1, 2, 4, 8):
        raise ValueError(
            f"num_bits={num_bits} cannot be packed into int32 words; use 4 or 8 bits "
            "(other widths are stored unpacked as int8, format naive-quantized)"
        )
    return 32 // num_bits


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
    per_word = _check_bits(num_bits)
    if unsigned_codes.dim() != 2 or dim not in (0, 1):
        raise ValueError(f"pack_int32 needs a 2-D tensor and dim 0 or 1, got shape "
                         f"{tuple(unsigned_codes.shape)} and dim={dim}")
    u = unsigned_codes.to(torch.int64)
    if u.numel() and (int(u.min()) < 0 or int(u.max()) >= 1 << num_bits):
        raise ValueError(f"codes must lie in [0, {(1 << num_bits) - 1}] for {num_bits} bits; "
                         "convert signed codes with to_unsigned() first")
    if dim == 0:
        u = u.t()
    rows, size = u.shape
    words = -(-size // per_word)
    u = F.pad(u, (0, words * per_word - size)).view(rows, words, per_word)  # zero padding
    shifts = torch.arange(per_word, dtype=torch.int64, device=u.device) * num_bits
    packed = (u << shifts).sum(-1)  # int64 in [0, 2^32): bit fields do not overlap
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return (packed.t() if dim == 0 else packed).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of `pack_int32`: int32 unsigned codes with `size` entries along `dim`.

    packed: int32 [R, W] (dim=1) or [W, C] (dim=0); padding beyond `size` is dropped.
    """
    per_word = _check_bits(num_bits)
    if packed.dim() != 2 or dim not in (0, 1):
        raise ValueError(f"unpack_int32 needs a 2-D tensor and dim 0 or 1, got shape "
                         f"{tuple(packed.shape)} and dim={dim}")
    p = packed.to(torch.int64) & _MASK32
    if dim == 0:
        p = p.t()
    rows, words = p.shape
    if size > words * per_word:
        raise ValueError(f"size={size} exceeds the {words * per_word} codes that {words} words "
                         f"of {num_bits}-bit codes hold")
    shifts = torch.arange(per_word, dtype=torch.int64, device=p.device) * num_bits
    u = ((p.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)).reshape(rows, words * per_word)
    u = u[:, :size].to(torch.int32)
    return (u.t() if dim == 0 else u).contiguous()
