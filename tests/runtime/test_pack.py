"""Bit layout of compressed-tensors pack-quantized (docs/architecture.md, "The safetensors"),
checked against fixed words computed independently of our packer."""

import pytest
import torch

from slimserve.kernels import reference
from slimserve.runtime.artifact.pack import pack_int32, to_signed, to_unsigned, unpack_int32


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
    assert torch.equal(
        ct.pack_to_int32(q, 4, packed_dim=0), pack_int32(to_unsigned(q, 4), 4, dim=0)
    )


def test_bad_inputs_raise_with_the_value():
    with pytest.raises(ValueError, match="num_bits=9"):
        pack_int32(torch.zeros(1, 8, dtype=torch.int32), 9)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int32(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError, match="size=9"):
        unpack_int32(torch.zeros(1, 1, dtype=torch.int32), 4, 9)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("size", [1, 7, 33, 127])
def test_dense_packing_matches_compressed_tensors(bits, size):
    """llm-compressor writes 3-bit (and other widths) as dense pack-quantized; we read and write it alike."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    torch.manual_seed(bits * 1000 + size)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, size), dtype=torch.int8)
    ours = pack_int32(q.int() + (1 << (bits - 1)), bits, dim=1)
    assert torch.equal(ours, pack_to_int32(q, bits, packed_dim=1))
    assert torch.equal(
        pack_int32(q.t().int() + (1 << (bits - 1)), bits, dim=0),
        pack_to_int32(q.t().contiguous(), bits, packed_dim=0),
    )
    assert torch.equal(unpack_int32(ours, bits, size) - (1 << (bits - 1)), q.int())


def test_quant_linear_reads_dense_3bit_pack_quantized():
    """A W3 g32 pack-quantized layer as llm-compressor writes it dequantizes to (q - 0) * scale."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from slimserve.runtime.artifact.scheme import QuantArgs, QuantScheme
    from slimserve.runtime.layers.quant_linear import QuantLinear

    torch.manual_seed(3)
    n, k, g = 12, 96, 32
    q = torch.randint(-4, 4, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // g, dtype=torch.bfloat16) + 0.01
    lin = QuantLinear(k, n, False, QuantScheme(QuantArgs(3, group_size=g)), "pack-quantized")
    lin.load_state_dict(
        {
            "weight_packed": pack_to_int32(q, 3),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k]),
        },
        strict=False,
    )
    expected = (q.float() * scale.float().repeat_interleave(g, dim=1)).to(torch.bfloat16)
    assert torch.equal(lin.dequantized_weight(torch.bfloat16), expected)
