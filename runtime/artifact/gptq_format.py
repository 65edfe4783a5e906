"""The AutoGPTQ / GPTQModel checkpoint layout (`quant_method: "gptq"`): config block and tensors.

Layout (docs/architecture.md, "GPTQ and AWQ checkpoints"), per quantized Linear `<prefix>`:
  qweight int32 [K*b/32, N]  unsigned codes packed along the input dim, lowest k in the low bits
  qzeros  int32 [G, N*b/32]  unsigned zero points packed along the output dim
  scales        [G, N]       in the layer dtype (fp16 for an fp16 model; see `disk_scales`)
  g_idx   int32 [K]          group of each input column, always written (as AutoGPTQ does)
Our signed codes q map to GPTQ's unsigned u = q + 2^(b-1); a symmetric scheme's implicit zero
is 2^(b-1) (8 for 4-bit). v1 ("gptq", what AutoGPTQ writes and every loader reads) stores each
zero minus 1; v2 ("gptq_v2", GPTQModel) stores it as is. A zero point of 0 cannot be written
in v1 (it would be stored as -1 and read back as 2^b), so `needs_v2` tells the exporter to
switch that artifact to v2.
"""

from __future__ import annotations

import torch

from slimserve.runtime.artifact.pack import pack_int32, to_unsigned
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantArgs, QuantScheme, SchemeError

QUANT_METHOD = "gptq"
V1 = "gptq"  # checkpoint_format of AutoGPTQ files: zeros stored minus 1
V2 = "gptq_v2"  # GPTQModel's format: zeros stored as they are
BITS = (2, 4, 8)  # widths that tile an int32 word; 3-bit needs AutoGPTQ's straddling packing
DAMP_PERCENT = 0.01  # AutoGPTQ's default Hessian damping, recorded in the config


def check_gptq_scheme(scheme: QuantScheme) -> None:
    """Raise SchemeError naming the problem and the fix if `scheme` has no GPTQ encoding."""
    w, acts = scheme.weights, scheme.input_activations
    if acts is not None:
        raise SchemeError(
            f"scheme with {acts.num_bits}-bit {acts.type} {acts.strategy} input activations "
            "(e.g. W8A8) cannot be exported as gptq, which stores weight-only schemes; export "
            "format 'compressed-tensors', or use a weight-only scheme such as W4A16 or W8A16"
        )
    if w.type != "int":
        raise SchemeError(
            f"{w.type} weights cannot be exported as gptq (integer codes only); "
            "export format 'compressed-tensors'"
        )
    if w.num_bits == 3:
        raise SchemeError(
            "3-bit weights cannot be exported as gptq: AutoGPTQ packs 3-bit codes across int32 "
            "word boundaries, which slimserve does not write; use bits 4 (W4A16) or export "
            "format 'compressed-tensors' (3-bit is stored unpacked there)"
        )
    if w.num_bits not in BITS:
        raise SchemeError(f"num_bits={w.num_bits} cannot be exported as gptq; use 2, 4 or 8")
    if w.strategy not in ("group", "channel"):
        raise SchemeError(
            f"weight strategy {w.strategy!r} cannot be exported as gptq, which has one scale per "
            "group or per output channel; use group_size 128 (or -1 for per channel)"
        )


def is_monotonic(g_idx: torch.Tensor) -> bool:
    """True when every input column's group is >= the previous one's (no act-order shuffle)."""
    return bool((g_idx[1:] >= g_idx[:-1]).all()) if g_idx.numel() > 1 else True


def unsigned_zeros(qw: QuantizedWeight) -> torch.Tensor:
    """int32 [N, G] unsigned zero points; 2^(b-1) everywhere for a symmetric scheme."""
    b = qw.args.num_bits
    if qw.zero_point is None:
        return torch.full(tuple(qw.scale.shape), 1 << (b - 1), dtype=torch.int32)
    return to_unsigned(qw.zero_point, b)


def needs_v2(qw: QuantizedWeight) -> bool:
    """True when a zero point is 0, which v1's "zero - 1" storage cannot hold (it underflows)."""
    return qw.zero_point is not None and bool((unsigned_zeros(qw) == 0).any())


def disk_scales(scale: torch.Tensor) -> torch.Tensor:
    """[G, N] scales from our [N, G], kept in the layer's storage dtype as AutoGPTQ writes them.

    AutoAWQ and GPTQModel buffers are fp16 and older fp16-only kernels run the whole model in
    fp16, but every loader casts scales to its own dtype on load; keeping the storage dtype
    keeps the dequantized weight bit-identical to our fake-quantized one (a bf16 scale below
    fp16's normal range would not survive a cast to fp16).
    """
    return scale.t().contiguous()


def _check_shape(prefix: str, qw: QuantizedWeight) -> None:
    n, k = qw.shape
    per_word = 32 // qw.args.num_bits
    if k % per_word or n % per_word:
        raise SchemeError(
            f"{prefix}: shape [{n}, {k}] cannot be exported as gptq, whose loaders need both "
            f"dims to be multiples of {per_word} for {qw.args.num_bits}-bit codes; ignore this "
            "module or export format 'compressed-tensors'"
        )
    g = qw.args.group_size if qw.args.strategy == "group" else k
    if k % g:
        raise SchemeError(
            f"{prefix}: in_features={k} is not a multiple of group_size={g}, which gptq loaders "
            "(vLLM) require; use a group_size that divides it or export 'compressed-tensors'"
        )


def gptq_tensors(
    prefix: str, qw: QuantizedWeight, *, checkpoint_format: str = V1
) -> dict[str, torch.Tensor]:
    """The tensors that replace `<prefix>.weight` on disk (bias is written separately).

    checkpoint_format: V1 (zeros stored minus 1) or V2 (as is). Raises SchemeError for a scheme
    or shape GPTQ cannot hold, and for a zero point of 0 in V1 (use V2, see `needs_v2`).
    """
    check_gptq_scheme(QuantScheme(qw.args))
    _check_shape(prefix, qw)
    b = qw.args.num_bits
    zeros = unsigned_zeros(qw)  # [N, G]
    if checkpoint_format == V1:
        if bool((zeros == 0).any()):
            raise SchemeError(
                f"{prefix}: a zero point of 0 cannot be stored in gptq v1 (it "
                f"underflows to -1); write checkpoint_format {V2!r}"
            )
        zeros = zeros - 1
    elif checkpoint_format != V2:
        raise ValueError(f"checkpoint_format={checkpoint_format!r}; use {V1!r} or {V2!r}")
    codes = to_unsigned(qw.codes, b)  # [N, K]
    return {
        f"{prefix}.qweight": pack_int32(codes, b, dim=1).t().contiguous(),  # [K*b/32, N]
        f"{prefix}.qzeros": pack_int32(zeros, b, dim=0).t().contiguous(),  # [G, N*b/32]
        f"{prefix}.scales": disk_scales(qw.scale),
        f"{prefix}.g_idx": qw.group_index().to(torch.int32),
    }


def gptq_config(
    args: QuantArgs,
    *,
    desc_act: bool = False,
    checkpoint_format: str = V1,
    damp_percent: float = DAMP_PERCENT,
) -> dict:
    """The `quantization_config` block, also written verbatim as quantize_config.json.

    desc_act: True when some g_idx is non-monotonic (act-order without static groups).
    """
    check_gptq_scheme(QuantScheme(args))
    return {
        "bits": args.num_bits,
        "checkpoint_format": checkpoint_format,
        "damp_percent": damp_percent,
        "desc_act": desc_act,
        "group_size": args.group_size if args.strategy == "group" else -1,
        "model_file_base_name": None,
        "model_name_or_path": None,
        "quant_method": QUANT_METHOD,
        "static_groups": False,
        "sym": args.symmetric,
        "true_sequential": True,
    }
