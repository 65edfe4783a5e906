"""Bit layout of compressed-tensors pack-quantized (formats.md §1.5 and §6 test vectors)."""

import pytest
import torch

from slimserve.compress.export.pack import pack_int32, to_signed, to_unsigned, unpack_int32
from slimserve.kernels import reference


def _word(t: torch.Tensor) -> int:
    return int(t.item()) & 0xFFFFFFFF


def test_ct_int4_row_vector():
    q = torch.tensor([[-8, -7, -1, 0, 1, 2, 6, 7]], dtype=torch.int8)
    packed = pack_int32(to_unsigned(q, 4), 4, dim=1)
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert _word(packed) == 0xFEA98710
    assert int(packed.item()) == -22444272


def test_ct_int4_all_zero_codes():
    assert _word(pack_int32(to_unsigned(torch.zeros(1, 8, dtype=torch.int8), 4), 4)) == 0x88888888


def test_zero_point_packing_along_dim0_gives_same_word():
    zp = torch.tensor([[-8], [-7], [-1], [0], [1], [2], [6], [7]], dtype=torch.int8)  # [N=8, G=1]
    packed = pack_int32(to_unsigned(zp, 4), 4, dim=0)
    assert packed.shape == (1, 1) and _word(packed) == 0xFEA98710
    assert torch.equal(reference.unpack_zero_point(packed, 4, 8), zp.int())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [1, 7, 13, 127, 128])
def test_round_trip_odd_sizes(bits, k):
    g = torch.Generator().manual_seed(k * bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = torch.randint(lo, hi, (5, k), generator=g, dtype=torch.int8)
    for dim in (0, 1):
        src = q if dim == 1 else q.t().contiguous()
        packed = pack_int32(to_unsigned(src, bits), bits, dim=dim)
        words = -(-k * bits // 32)
        assert packed.shape == ((5, words) if dim == 1 else (words, 5))
        back = to_signed(unpack_int32(packed, bits, k, dim=dim), bits)
        assert torch.equal(back, src)
    # the kernel oracle's independent unpacker reads the same layout
    unpack = reference.unpack_int4_weight if bits == 4 else reference.unpack_int8_weight
    assert torch.equal(unpack(pack_int32(to_unsigned(q, bits), bits), k), q.int())


def test_padding_is_zero_and_8bit_layout():
    packed = pack_int32(torch.tensor([[1, 2, 3]]), 8)  # unsigned bytes, last byte padded
    assert _word(packed) == 0x00030201
    assert _word(pack_int32(to_unsigned(torch.zeros(1, 4, dtype=torch.int8), 8), 8)) == 0x80808080


def test_matches_installed_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (9, 45), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(ct.pack_to_int32(q, 4), pack_int32(to_unsigned(q, 4), 4))
    assert torch.equal(ct.pack_to_int32(q, 4, packed_dim=0), pack_int32(to_unsigned(q, 4), 4, dim=0))


def test_bad_inputs_raise_with_the_value():
    with pytest.raises(ValueError, match="num_bits=3"):
        pack_int32(torch.zeros(1, 8, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int32(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError, match="size=9"):
        unpack_int32(torch.zeros(1, 1, dtype=torch.int32), 4, 9)
