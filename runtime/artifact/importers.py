"""Read GPTQ (AutoGPTQ v1 / GPTQModel v2) and AutoAWQ GEMM checkpoints as compressed-tensors.

The loader only knows compressed-tensors (CT) buffers (QuantLinear). An importer turns each
quantized Linear's tensors into CT tensors holding the same codes, zero points and scales
(docs/architecture.md, "Which loader reads what"), and writes a CT `quantization_config` whose
config groups name those modules exactly, so `replace_linears` and the strict loader handle the
rest:
  GPTQ  weight_packed = qweight.T (4/8-bit, same bit layout); weight_scale = scales.T;
        zeros: unpacked, +1 per field for v1, then CT-packed along N (dropped when symmetric);
        g_idx kept as weight_g_idx (actorder "group") unless it is the default k // g.
        GPTQModel's per-module `dynamic` overrides (bits, group_size, sym) are honoured.
  AWQ   qweight/qzeros unpacked with the interleave undone, CT-packed; weight_scale = scales.T.
2-bit GPTQ, and v1 zero points that read back as 2^b (AutoGPTQ's zero-0 underflow, see
gptq_format.py: every v1 kernel then subtracts 2^b, and so do we), become CT naive-quantized
int8 buffers.
Everything is read through safetensors; nothing is unpickled.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from slimserve.runtime.artifact.awq_format import unpack_awq
from slimserve.runtime.artifact.compressed_tensors import QUANT_METHOD as CT_METHOD
from slimserve.runtime.artifact.compressed_tensors import scheme_dict
from slimserve.runtime.artifact.pack import pack_int32, unpack_int32
from slimserve.runtime.artifact.scheme import QuantArgs, QuantScheme, SchemeError
from slimserve.runtime.errors import ArtifactError

GPTQ, AWQ = "gptq", "awq"
PACKED, NAIVE = "pack-quantized", "naive-quantized"
# side files AutoGPTQ / AutoAWQ write; read only when config.json has no quantization_config
SIDE_FILES = (("quantize_config.json", GPTQ), ("quant_config.json", AWQ))
ConvertedLinear = tuple[QuantScheme, str, dict[str, torch.Tensor]]  # scheme, CT format, CT tensors


def read_quant_config(path: Path) -> dict | None:
    """The checkpoint's quantization block, with `quant_method` lower-cased and normalized.

    config.json's `quantization_config` wins; otherwise quantize_config.json (GPTQ) or
    quant_config.json (AWQ, legacy `w_bit`/`q_group_size` spelling) is used. None if unquantized.
    """
    qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    default = None
    if not qc:
        for name, method in SIDE_FILES:
            if (path / name).is_file():
                qc, default = json.loads((path / name).read_text()), method
                break
    if not qc:
        return None
    method = str(qc.get("quant_method") or qc.get("method") or default or "").lower()
    return {**qc, "quant_method": CT_METHOD if method == "compressed_tensors" else method}


def import_checkpoint(qc: dict, tensors: dict[str, torch.Tensor], path: Path) -> tuple[dict, dict]:
    """(CT quantization_config, CT tensors) for a checkpoint of any supported quant_method."""
    method = qc.get("quant_method")
    if method == CT_METHOD:
        return qc, tensors
    if method not in IMPORTERS:
        raise ArtifactError(
            f"{path}: quant_method {method!r} is not supported; supported: "
            f"{', '.join((CT_METHOD, *IMPORTERS))}"
        )
    convert = IMPORTERS[method](qc, path)
    out = {k: v for k, v in tensors.items()}
    groups: dict[tuple[QuantScheme, str], list[str]] = {}
    for prefix in sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")):
        try:
            scheme, fmt, ct = convert(prefix, out)
        except (SchemeError, ValueError, KeyError) as e:
            raise ArtifactError(f"{path}: {prefix} is not a readable {method} layer: {e}") from None
        out.update(ct)
        groups.setdefault((scheme, fmt), []).append(prefix)
    if not groups:
        raise ArtifactError(
            f"{path}: config.json says quant_method {method!r} but no tensor ends in "
            "'.qweight'; the weight files do not match the config"
        )
    config_groups = {
        f"group_{i}": {**scheme_dict(s, names), "format": fmt}
        for i, ((s, fmt), names) in enumerate(groups.items())
    }
    formats = {fmt for _, fmt in groups}
    ct_qc = {
        "quant_method": CT_METHOD,
        "config_groups": config_groups,
        "ignore": [],
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }
    return ct_qc, out


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise KeyError(f"missing tensor {key}")
    return tensors.pop(key)


def _args(bits: int, group_size: int | None, symmetric: bool, actorder: str | None) -> QuantArgs:
    if group_size in (None, -1):
        return QuantArgs(bits, symmetric=symmetric, strategy="channel", group_size=None)
    return QuantArgs(
        bits, symmetric=symmetric, strategy="group", group_size=group_size, actorder=actorder
    )


def linear_to_ct(
    prefix: str,
    weight_packed: torch.Tensor,
    in_features: int,
    unsigned_zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    symmetric: bool,
) -> ConvertedLinear:
    """CT buffers of one Linear.

    weight_packed: int32 [N, ceil(K*b/32)] unsigned codes in CT's layout (packed along K, lowest
    k in the low bits), i.e. GPTQ's qweight.T. unsigned_zeros: int [N, G], up to 2^b for a v1
    underflow. scales: [N, G]. g_idx: [K], dropped when it is the default k // g.
    """
    n, k = weight_packed.shape[0], in_features
    half = 1 << (bits - 1)
    if symmetric and not bool((unsigned_zeros == half).all()):
        symmetric = False  # the stored zeros are what non-Marlin kernels use: keep them
    default = (
        torch.arange(k) // group_size
        if group_size not in (None, -1)
        else torch.zeros(k, dtype=torch.long)
    )
    if g_idx is not None and torch.equal(g_idx.long(), default):
        g_idx = None
    args = _args(bits, group_size, symmetric, "group" if g_idx is not None else None)
    out = {f"{prefix}.weight_scale": scales.contiguous()}
    if g_idx is not None:
        out[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32).contiguous()
    if bits in (4, 8) and bool((unsigned_zeros < (1 << bits)).all()):
        out[f"{prefix}.weight_packed"] = weight_packed.contiguous()
        out[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not symmetric:
            out[f"{prefix}.weight_zero_point"] = pack_int32(unsigned_zeros, bits, dim=0)
        return QuantScheme(args), PACKED, out
    zp = unsigned_zeros - half  # naive-quantized: signed int8 codes and zero points
    if int(zp.max()) > 127:
        raise ValueError(
            f"a zero point of {int(unsigned_zeros.max())} (v1 underflow) does not fit int8"
        )
    codes = unpack_int32(weight_packed, bits, k, dim=1)
    out[f"{prefix}.weight"] = (codes - half).to(torch.int8)
    if not symmetric:
        out[f"{prefix}.weight_zero_point"] = zp.to(torch.int8).contiguous()
    return QuantScheme(args), NAIVE, out


def _gptq_converter(qc: dict, path: Path):
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ArtifactError(
            f"{path}: GPTQ checkpoint_format {fmt!r} is not supported; supported: "
            "gptq (v1), gptq_v2"
        )
    v1 = fmt == "gptq"
    base = {
        "bits": int(qc.get("bits", 4)),
        "group_size": qc.get("group_size", 128),
        "sym": bool(qc.get("sym", True)),
    }
    dynamic = qc.get("dynamic") or {}
    for params in [base, *(o for o in dynamic.values() if isinstance(o, dict))]:
        bits = int(params.get("bits", base["bits"]))
        if bits not in (2, 4, 8):
            raise ArtifactError(
                f"{path}: GPTQ bits={bits} is not supported (3-bit uses AutoGPTQ's "
                "word-straddling packing); supported: 2, 4, 8"
            )

    def convert(prefix: str, t: dict[str, torch.Tensor]) -> ConvertedLinear:
        p = {**base, **gptq_dynamic_override(dynamic, prefix)}
        bits, group_size, sym = int(p["bits"]), p["group_size"], bool(p["sym"])
        qweight = _take(t, f"{prefix}.qweight")  # [K*b/32, N]
        qzeros = _take(t, f"{prefix}.qzeros")  # [G, N*b/32]
        scales = _take(t, f"{prefix}.scales")  # [G, N]
        g_idx = t.pop(f"{prefix}.g_idx", None)  # [K]
        k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
        zeros = unpack_int32(qzeros, bits, n, dim=1).t() + int(v1)  # [N, G]; v1 stores zero - 1
        # qweight.T is bit-identical to CT's weight_packed (both pack along K, low k first)
        return linear_to_ct(prefix, qweight.t(), k, zeros, scales.t(), g_idx, bits, group_size, sym)

    return convert


def gptq_dynamic_override(dynamic: dict, module: str) -> dict:
    """GPTQModel's per-module `dynamic` overrides ({bits, group_size, sym, ...}) for `module`.

    Keys are regexes matched (re.match) against the full module name, in file order; the first
    match wins. A '-:' key excludes the module (it is stored dense, so it never reaches here);
    '+:' or no prefix applies the override dict. No match: {} (the global config applies).
    """
    for pattern, override in dynamic.items():
        negative = pattern.startswith("-:")
        raw = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        if re.match(raw, module):
            return (
                {}
                if negative or not isinstance(override, dict)
                else {k: override[k] for k in ("bits", "group_size", "sym") if k in override}
            )
    return {}


def _awq_converter(qc: dict, path: Path):
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise ArtifactError(
            f"{path}: AWQ bits={bits}, version={version!r}, zero_point="
            f"{qc.get('zero_point', True)} is not supported; supported: 4-bit GEMM "
            "with zero points (AutoAWQ's default)"
        )

    def convert(prefix: str, t: dict[str, torch.Tensor]) -> ConvertedLinear:
        codes = unpack_awq(_take(t, f"{prefix}.qweight")).t()  # [N, K]
        zeros = unpack_awq(_take(t, f"{prefix}.qzeros")).t()  # [N, G]
        scales = _take(t, f"{prefix}.scales").t()  # [N, G]
        packed = pack_int32(codes, bits, dim=1)  # CT layout [N, K/8]
        return linear_to_ct(
            prefix, packed, codes.shape[1], zeros, scales, None, bits, group_size, False
        )

    return convert


IMPORTERS = {GPTQ: _gptq_converter, AWQ: _awq_converter}  # quant_method -> converter factory
