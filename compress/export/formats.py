"""The export formats a recipe can name, and the one entry point that writes any of them.

  compressed-tensors  every scheme we quantize; vLLM's native format
  gptq                AutoGPTQ v1 layout: weight-only int 2/4/8-bit, group or channel,
                      symmetric or not, act-order g_idx; one scheme for every decoder Linear.
                      An asymmetric zero point of 0, which v1 cannot store (it underflows),
                      switches the whole artifact to GPTQModel's lossless "gptq_v2" layout
  awq                 AutoAWQ GEMM layout: weight-only int4 group, asymmetric (a
                      symmetric scheme is written as asymmetric with zero point 8), no act-order

The layouts: docs/architecture.md, "The artifact contract".

What each format can hold beyond its schemes is stated once, in `LIMITS`:

  format              partial groups   fp8 KV scales   different schemes per Linear
  compressed-tensors  yes (1)          yes             yes
  gptq                no               no              no
  awq                 no               no              no (only the group size counts)

  (1) only slimserve's loaders read them: compressed-tensors, transformers and vLLM refuse a group
      size that does not divide a Linear's in_features, so a recipe must opt in with
      `export.allow_partial_groups: true` (compress/quant/group_sizes.py).

`check_exportable` refuses a scheme (and an opt-in the format cannot honour) before any work is
done; `export_artifact` re-checks every module at export time, where shapes and g_idx are known.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimserve.compress.export.io import (
    ExportOptions,
    artifact_tensors,
    compressed_tensors_plan,
    export_compressed_tensors,
    linear_classes,
    write_artifact,
)
from slimserve.compress.export.shards import all_quantized, layer_by_layer_weights
from slimserve.compress.layer_store import LayerStore
from slimserve.compress.moe import dense_modules
from slimserve.runtime.artifact import awq_format, gptq_format
from slimserve.runtime.artifact.compressed_tensors import SUPPORTED_FORMATS
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantScheme, SchemeError

COMPRESSED_TENSORS = "compressed-tensors"
GPTQ = "gptq"
AWQ = "awq"
FORMATS = (COMPRESSED_TENSORS, GPTQ, AWQ)
GPTQ_CONFIG_FILE = (
    "quantize_config.json"  # AutoGPTQ's side file, read when config.json lacks the block
)


@dataclass(frozen=True, slots=True)
class FormatLimits:
    """What a format can store besides the schemes its `check_*_scheme` accepts."""

    partial_groups: bool  # a last input group narrower than group_size (group_size not dividing K)
    kv_cache_scales: bool  # static fp8 K/V scales per attention module
    mixed_schemes: bool  # different weight schemes for different Linears


LIMITS = {
    COMPRESSED_TENSORS: FormatLimits(partial_groups=True, kv_cache_scales=True, mixed_schemes=True),
    GPTQ: FormatLimits(partial_groups=False, kv_cache_scales=False, mixed_schemes=False),
    AWQ: FormatLimits(partial_groups=False, kv_cache_scales=False, mixed_schemes=False),
}


def check_exportable(fmt: str, scheme: QuantScheme, partial_groups: bool = False) -> None:
    """Raise SchemeError (naming the scheme's problem and the fix) if `fmt` cannot store `scheme`,
    or, with `partial_groups`, a scheme whose group size leaves some Linear a partial last group."""
    if fmt not in LIMITS:
        raise SchemeError(f"export format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    w = scheme.weights
    if partial_groups and w.strategy == "group" and not LIMITS[fmt].partial_groups:
        raise SchemeError(
            f"export.allow_partial_groups: {fmt} checkpoints cannot hold partial groups "
            f"(its loaders need group_size {w.group_size} to divide every in_features); "
            "export format 'compressed-tensors' or use a group_size that divides them"
        )
    if fmt == COMPRESSED_TENSORS:
        if scheme.ct_format() not in SUPPORTED_FORMATS:
            raise SchemeError(
                f"scheme {scheme} needs compressed-tensors format "
                f"{scheme.ct_format()!r}, which is not exported yet; supported: "
                f"{', '.join(SUPPORTED_FORMATS)}"
            )
    elif fmt == GPTQ:
        gptq_format.check_gptq_scheme(scheme)
    else:
        awq_format.check_awq_scheme(scheme)


def export_artifact(fmt: str, *args: Any, layers: LayerStore | None = None, **kwargs: Any) -> Path:
    """Export a model in format `fmt` (atomically) and return the artifact's folder.

    Arguments: one `ExportOptions` (compress/export/io.py), or its fields as for
    `export_compressed_tensors`; `out_dir` must be free, empty or an earlier artifact
    (ArtifactError otherwise, before anything is written). gptq and awq need at least one quantized
    Linear and one weight scheme shared by all of them, and have no place for fp8 KV-cache
    scales; SchemeError says what to change. With `layers` (compress/layer_store.py) the model
    holds no decoder layer and `quantized` holds the committed layers' weights as shapes only:
    the weights are written layer by layer (compress/export/shards.py), the same tensors.
    """
    opts = ExportOptions.of(*args, **kwargs)
    model, quantized = opts.model, opts.quantized

    def weights(linear_fn, extra=None):
        if layers is not None:
            return layer_by_layer_weights(model, layers, quantized, linear_fn, extra)
        return {**artifact_tensors(model, quantized, linear_fn), **(extra or {})}

    if fmt == COMPRESSED_TENSORS:
        if layers is None:
            return export_compressed_tensors(opts)
        linear_fn, extra, qc = compressed_tensors_plan(opts)
        return write_artifact(opts, weights(linear_fn, extra), qc)
    if fmt not in FORMATS:
        raise SchemeError(f"export format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    if opts.kv_scales and not LIMITS[fmt].kv_cache_scales:
        raise SchemeError(
            f"fp8 KV-cache scales cannot be stored in a {fmt} checkpoint; export "
            "format 'compressed-tensors' or drop the kv_cache stage"
        )
    for name, qw in quantized.items():
        try:
            check_exportable(fmt, (opts.schemes or {}).get(name) or QuantScheme(qw.args))
        except SchemeError as e:
            raise SchemeError(f"{name}: {e}") from None
    unquantized = _check_modules(fmt, model, quantized)
    if fmt == GPTQ:
        v2 = desc_act = False
        for _, qw in all_quantized(quantized, layers):  # layer by layer when the layers are on disk
            v2 = v2 or gptq_format.needs_v2(qw)
            desc_act = desc_act or not gptq_format.is_monotonic(qw.group_index())
        version = gptq_format.V2 if v2 else gptq_format.V1
        qc = gptq_format.gptq_config(
            next(iter(quantized.values())).args, desc_act=desc_act, checkpoint_format=version
        )
        tensors = weights(lambda n, qw: gptq_format.gptq_tensors(n, qw, checkpoint_format=version))
        return write_artifact(opts, tensors, qc, {GPTQ_CONFIG_FILE: qc})
    qc = awq_format.awq_config(next(iter(quantized.values())).args, unquantized)
    return write_artifact(opts, weights(awq_format.awq_tensors), qc)


def _output_embedding_name(model: torch.nn.Module) -> str | None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (
        next((n for n, m in model.named_modules() if m is out), None) if out is not None else None
    )


def _check_modules(
    fmt: str, model: torch.nn.Module, quantized: dict[str, QuantizedWeight]
) -> list[str]:
    """Check what a single-config format can describe; return the unquantized Linears' names.

    gptq and awq have one global scheme, never quantize the output embedding (lm_head), and
    gptq loaders quantize every other Linear (awq lists the rest in modules_to_not_convert).
    """
    if not quantized:
        raise SchemeError(
            f"export format {fmt!r} needs quantized Linears and none were quantized; "
            "add a quantization stage (e.g. rtn) or export 'compressed-tensors'"
        )
    if fmt == GPTQ:  # the whole config is global, so every module needs the same arguments
        key = lambda a: (a.num_bits, a.symmetric, a.strategy, a.group_size)  # noqa: E731
    else:  # awq writes symmetric schemes as asymmetric, so only the group size must agree
        key = lambda a: a.group_size  # noqa: E731
    first_name, first = next(iter(quantized.items()))
    for name, qw in quantized.items():
        if not LIMITS[fmt].mixed_schemes and key(qw.args) != key(first.args):
            raise SchemeError(
                f"{name} is quantized as {qw.args} but {first_name} as {first.args}; a {fmt} "
                "checkpoint has one scheme for all Linears, so quantize them alike or export "
                "'compressed-tensors'"
            )
    head = _output_embedding_name(model)
    if head in quantized:
        raise SchemeError(
            f"{head} (the output embedding) is quantized, which {fmt} loaders do not "
            f"expect; add {head!r} to the stage's ignore list or export 'compressed-tensors'"
        )
    unquantized = [n for n in linear_classes(model) if n not in quantized]
    dense = dense_modules(model)  # routers: every loader keeps them dense (compress/moe.py)
    stray = [n for n in unquantized if n != head and n not in dense]
    if fmt == GPTQ and stray:
        raise SchemeError(
            f"{stray[0]} is not quantized, but gptq loaders quantize every Linear of the decoder "
            "layers; quantize it too, or export 'awq' or 'compressed-tensors' (they can list "
            "unquantized modules)"
        )
    return unquantized
