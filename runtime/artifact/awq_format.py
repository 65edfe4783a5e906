"""The AutoAWQ GEMM checkpoint layout (`quant_method: "awq"`, `version: "gemm"`).

Layout (docs/architecture.md, "GPTQ and AWQ checkpoints"), per quantized Linear `<prefix>`:
  qweight int32 [K, N/8]   unsigned 4-bit codes packed along the OUTPUT dim, interleaved
  qzeros  int32 [K/g, N/8] unsigned zero points, same packing
  scales        [K/g, N]   in the layer dtype (AutoAWQ's fp16 for an fp16 model)
Inside each word, nibble i holds output column 8c + ORDER[i]. There is no g_idx (groups are
always k // g) and no "-1" convention. AWQ GEMM is asymmetric only; a symmetric scheme is
written losslessly as asymmetric with every zero point at 8 (signed 0): (u - 8) * s == q * s.
"""

from __future__ import annotations

import torch

from slimserve.runtime.artifact.gptq_format import disk_scales, unsigned_zeros
from slimserve.runtime.artifact.pack import pack_int32, to_unsigned
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantArgs, QuantScheme, SchemeError

QUANT_METHOD = "awq"
VERSION = "gemm"
BITS = 4
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output column 8c + ORDER[i]
REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # argsort(ORDER): output column 8c + j sits in nibble REVERSE[j]


def check_awq_scheme(scheme: QuantScheme) -> None:
    """Raise SchemeError naming the problem and the fix if `scheme` has no AWQ GEMM encoding."""
    w, acts = scheme.weights, scheme.input_activations
    if acts is not None:
        raise SchemeError(
            f"scheme with {acts.num_bits}-bit {acts.type} {acts.strategy} input activations "
            "(e.g. W8A8) cannot be exported as awq, which stores weight-only 4-bit schemes; "
            "export format 'compressed-tensors', or use W4A16_ASYM"
        )
    if w.type != "int" or w.num_bits != BITS:
        raise SchemeError(
            f"{w.num_bits}-bit {w.type} weights cannot be exported as awq (AutoAWQ GEMM is 4-bit "
            "int only); use scheme W4A16_ASYM, or export format 'compressed-tensors'"
        )
    if w.strategy != "group":
        raise SchemeError(
            f"weight strategy {w.strategy!r} cannot be exported as awq, which has one scale per "
            "group of input columns; use group_size 128 (W4A16_ASYM)"
        )
    if w.actorder == "group":
        raise SchemeError(
            "actorder 'group' (shuffled g_idx) cannot be exported as awq, which has no g_idx; "
            "use actorder 'static' or none, or export format 'gptq' or 'compressed-tensors'"
        )


def _check_weight(prefix: str, qw: QuantizedWeight) -> None:
    check_awq_scheme(QuantScheme(qw.args))
    n, k = qw.shape
    g = qw.args.group_size
    if n % 8 or k % g:
        raise SchemeError(
            f"{prefix}: shape [{n}, {k}] cannot be exported as awq, which needs out_features % 8 "
            f"== 0 and in_features % group_size ({g}) == 0; ignore this module or export "
            "format 'compressed-tensors'"
        )
    if not torch.equal(qw.group_index(), torch.arange(k) // g):
        raise SchemeError(
            f"{prefix}: its g_idx is not k // group_size (act-order), which awq cannot store; "
            "quantize without actorder or export format 'gptq' or 'compressed-tensors'"
        )


def pack_awq(unsigned: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] from unsigned 4-bit codes [R, C], packed along C with the AWQ interleave."""
    r, c = unsigned.shape
    if c % 8:
        raise ValueError(f"AWQ packs 8 columns per word; got {c} columns")
    interleaved = unsigned.reshape(r, c // 8, 8)[:, :, list(ORDER)].reshape(r, c)
    return pack_int32(interleaved, BITS, dim=1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, 8W] unsigned codes from AWQ-interleaved int32 [R, W]; the inverse of pack_awq."""
    r, words = packed.shape
    # column j: nibble REVERSE[j]
    shifts = torch.tensor(REVERSE, dtype=torch.int32, device=packed.device) * BITS
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then masked
    return fields.reshape(r, words * 8)


def awq_tensors(prefix: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The tensors that replace `<prefix>.weight` on disk (bias is written separately).

    Raises SchemeError for a scheme, shape or g_idx AWQ GEMM cannot hold.
    """
    _check_weight(prefix, qw)
    codes = to_unsigned(qw.codes, BITS).t()  # [K, N]
    zeros = unsigned_zeros(qw).t()  # [G, N]; 8 for a symmetric scheme
    return {
        f"{prefix}.qweight": pack_awq(codes).contiguous(),
        f"{prefix}.qzeros": pack_awq(zeros).contiguous(),
        f"{prefix}.scales": disk_scales(qw.scale),
    }


def awq_config(args: QuantArgs, modules_to_not_convert: list[str] | None = None) -> dict:
    """The `quantization_config` block of config.json (transformers' AwqConfig spelling).

    modules_to_not_convert: Linears left unquantized (loaders match them as substrings).
    """
    check_awq_scheme(QuantScheme(args))
    return {
        "bits": BITS,
        "group_size": args.group_size,
        "modules_to_not_convert": list(modules_to_not_convert or []),
        "quant_method": QUANT_METHOD,
        "version": VERSION,
        "zero_point": True,
    }
