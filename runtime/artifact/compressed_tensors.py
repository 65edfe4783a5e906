"""The compressed-tensors (CT) view of quantized Linears: config block and on-disk tensors.

Layout: docs/architecture.md, "The artifact contract". We emit only the `QuantizationArgs` keys
CT 0.12 knows (its `extra="forbid"` rejects newer ones such as `zp_dtype`), never a zero point
for a symmetric scheme, and the `format` vLLM needs to pick a kernel (pack-quantized for
W4A16/W8A16).
"""

from __future__ import annotations

from importlib import metadata

import torch

from slimserve.runtime.artifact.pack import pack_int32, to_unsigned
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantArgs, QuantScheme

QUANT_METHOD = "compressed-tensors"
PACKED = "pack-quantized"
MIXED = "mixed-precision"  # CT's global format when groups use different formats
DENSE = "dense"  # CT's global format when no Linear is quantized (KV-cache scales only)
SUPPORTED_FORMATS = (PACKED, "naive-quantized", "int-quantized")
_CT_FALLBACK_VERSION = "0.12.2"
_ACTORDER_FROM_CT = {
    None: None,
    "weight": "static",
    "static": "static",
    "group": "group",
    "dynamic": "group",
    True: "group",
    False: None,
}


def ct_version() -> str:
    """Version string written to `quantization_config.version` (CT discards it on load)."""
    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        return _CT_FALLBACK_VERSION


def scheme_dict(scheme: QuantScheme, targets: list[str]) -> dict:
    """One `config_groups` entry (a CT `QuantizationScheme`)."""
    acts = scheme.input_activations
    return {
        "format": scheme.ct_format(),
        "input_activations": acts.to_ct_dict() if acts is not None else None,
        "output_activations": None,
        "targets": targets,
        "weights": scheme.weights.to_ct_dict(),
    }


def quantization_config(
    schemes: dict[str, QuantScheme], linears: dict[str, str], kv_cache: dict | None = None
) -> dict:
    """The `quantization_config` block of config.json.

    schemes: quantized module name -> its scheme, in model order.
    linears: every Linear-like module name in the model -> its class name (for targets/ignore).
    kv_cache: the `kv_cache_scheme` block (see `kv_cache_scheme()`), or None.
    One config group per distinct scheme. With a single group whose modules are all of class
    `Linear`, the target is ["Linear"] and every unquantized Linear is ignored; otherwise the
    groups list exact module names. Without schemes (a KV-cache-only artifact) config_groups is
    {} and the format "dense", which compressed-tensors' QuantizationConfig accepts.
    """
    groups: dict[QuantScheme, list[str]] = {}
    for name, scheme in schemes.items():
        groups.setdefault(scheme, []).append(name)
    by_class = len(groups) == 1 and all(linears.get(n) == "Linear" for n in schemes)
    unquantized = (n for n, cls in linears.items() if cls == "Linear" and n not in schemes)
    ignore = sorted(unquantized) if by_class else []
    config_groups = {
        f"group_{i}": scheme_dict(s, ["Linear"] if by_class else names)
        for i, (s, names) in enumerate(groups.items())
    }
    formats = {s.ct_format() for s in groups}
    return {
        "config_groups": config_groups,
        "format": formats.pop() if len(formats) == 1 else MIXED if formats else DENSE,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": kv_cache,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": ct_version(),
    }


def kv_cache_scheme() -> dict:
    """The `kv_cache_scheme` block for static per-tensor fp8 (e4m3) K/V scales (kv_scales.py).

    Only CT-0.12 `QuantizationArgs` keys, like the weight args.
    """
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor",
        "dynamic": False,
        "group_size": None,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def kv_tensors(
    kv_scales: dict[str, tuple[float, float]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`<attn>.k_scale` and `<attn>.v_scale`, shape [1] in the model dtype, per attention module.

    kv_scales: attention module name (e.g. model.layers.0.self_attn) -> (k_scale, v_scale).
    """
    out = {}
    for name, (k, v) in kv_scales.items():
        out[f"{name}.k_scale"] = torch.tensor([k], dtype=dtype)
        out[f"{name}.v_scale"] = torch.tensor([v], dtype=dtype)
    return out


def linear_tensors(
    prefix: str, qw: QuantizedWeight, scheme: QuantScheme
) -> dict[str, torch.Tensor]:
    """The tensors that replace `<prefix>.weight` on disk (bias is written separately).

    pack-quantized: weight_packed int32 [N, ceil(K*b/32)], weight_scale [N, G], weight_shape
    int64 [2], weight_zero_point int32 [ceil(N*b/32), G] (asymmetric only), weight_g_idx int32
    [K] (actorder "group" only). naive-/int-quantized: weight int8 [N, K], weight_scale [N, G],
    weight_zero_point int8 [N, G] (asymmetric only).
    """
    args = qw.args
    if args != scheme.weights:
        raise ValueError(
            f"{prefix}: the quantized weight's args {args} differ from its scheme's "
            f"weights {scheme.weights}; quantize with the scheme you export"
        )
    fmt = scheme.ct_format()
    if fmt not in SUPPORTED_FORMATS:
        raise ValueError(
            f"{prefix}: format {fmt!r} is not exported yet; "
            f"supported: {', '.join(SUPPORTED_FORMATS)}"
        )
    n, k = qw.shape
    out = {f"{prefix}.weight_scale": qw.scale.contiguous()}
    if fmt == PACKED:
        codes = to_unsigned(qw.codes, args.num_bits)
        out[f"{prefix}.weight_packed"] = pack_int32(codes, args.num_bits, dim=1)
        out[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not args.symmetric:
            zp = to_unsigned(qw.zero_point, args.num_bits)
            out[f"{prefix}.weight_zero_point"] = pack_int32(zp, args.num_bits, dim=0)
    else:
        out[f"{prefix}.weight"] = qw.codes.to(torch.int8).contiguous()
        if not args.symmetric:
            out[f"{prefix}.weight_zero_point"] = qw.zero_point.to(torch.int8).contiguous()
    if args.actorder == "group":
        out[f"{prefix}.weight_g_idx"] = qw.group_index().to(torch.int32)
    return out


def args_from_ct_dict(d: dict) -> QuantArgs:
    """Our QuantArgs from a CT `QuantizationArgs` dict (missing keys take CT's defaults)."""
    group_size = d.get("group_size")
    strategy = d.get("strategy") or (
        "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    )
    return QuantArgs(
        num_bits=int(d.get("num_bits", 8)),
        type=d.get("type", "int"),
        symmetric=bool(d.get("symmetric", True)),
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
        dynamic=bool(d.get("dynamic", False)),
        actorder=_ACTORDER_FROM_CT[d.get("actorder")],
    )


def scheme_from_ct_dict(group: dict) -> QuantScheme:
    """Our QuantScheme from one CT `config_groups` entry."""
    acts = group.get("input_activations")
    return QuantScheme(
        weights=args_from_ct_dict(group["weights"]),
        input_activations=args_from_ct_dict(acts) if acts else None,
    )
