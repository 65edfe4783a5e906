"""Load a model for serving: a slimserve / compressed-tensors artifact, a GPTQ or AWQ GEMM
checkpoint, a plain HF folder, a hub id, or a GGUF checkpoint (dequantized once into a cached HF
folder by runtime/loading/gguf.py).

Artifacts are built without transformers' own quantizer: the HF architecture is created from
config.json with the quantization block removed, GPTQ/AWQ tensors are converted to CT buffers
(importers.py), every targeted Linear becomes a QuantLinear holding the CT buffers, and the
safetensors are loaded strictly (no pickle, ever).

`load_skeleton` is the other way in, for compressing models larger than memory: the module tree
with every decoder layer's parameters on the meta device and only the rest loaded; the layers are
read one at a time later (runtime/loading/lazy_weights.py, compress/layer_store.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from slimserve.runtime.artifact.compressed_tensors import QUANT_METHOD, scheme_from_ct_dict
from slimserve.runtime.artifact.importers import IMPORTERS, import_checkpoint, read_quant_config
from slimserve.runtime.artifact.manifest import (
    MARKER_KEY,
    ArtifactManifest,
    check_artifact,
    read_config_json,
    unverified_manifest,
)
from slimserve.runtime.artifact.scheme import QuantScheme, SchemeError
from slimserve.runtime.artifact.targets import matches
from slimserve.runtime.artifact.weights import check_config_bounds, tensor_shapes, weight_files
from slimserve.runtime.dtypes import torch_dtype
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers.quant_linear import QuantLinear
from slimserve.runtime.loading.gguf import resolve_model
from slimserve.runtime.loading.hf_fp8kv import install_kv_scales
from slimserve.runtime.loading.lazy_weights import (
    CheckpointTensors,
    assign,
    empty_model,
    state_names,
)
from slimserve.runtime.loading.moe_experts import unfuse_experts

SUPPORTED_QUANT_METHODS = (QUANT_METHOD, *IMPORTERS)  # gptq/awq are converted to CT on load
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "org/name"
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
)  # any one: a tokenizer


@dataclass(slots=True)
class LoadedModel:
    """A model ready for inference and what the loader learnt about it."""

    model: nn.Module  # HF causal LM in eval mode, on the requested device
    tokenizer: object | None  # HF tokenizer, or None when the folder has none
    manifest: ArtifactManifest | None  # slimserve.json when present (already verified)
    quantized: bool  # True when Linears were replaced by QuantLinear


def _missing(path_or_id: str, cause: Exception | None = None) -> ArtifactError:
    why = f" ({cause})" if cause else ""
    return ArtifactError(
        f"no such model or artifact: {path_or_id}; pass a local folder with "
        f"config.json or a Hugging Face model id{why}"
    )


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    resolved = torch_dtype(dtype)
    if resolved is None and dtype is not None:
        raise ArtifactError(
            f"dtype={dtype!r} is not a torch dtype; use bfloat16, float16 or float32"
        )
    return resolved


def has_tokenizer(path: Path) -> bool:
    """Whether the folder holds a tokenizer (any of TOKENIZER_FILES)."""
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def check_quant_method(qc: dict, config_path: Path | str, convert_hint: bool = True) -> None:
    """ArtifactError unless `qc` names a quant_method the runtime loads (SUPPORTED_QUANT_METHODS).

    convert_hint: load_model's wording (not supported *yet*, and how to convert); build_model's
    message lists the supported methods only.
    """
    method = qc.get("quant_method")
    if method in SUPPORTED_QUANT_METHODS:
        return
    supported = ", ".join(SUPPORTED_QUANT_METHODS)
    if convert_hint:
        raise ArtifactError(
            f"{config_path}: quant_method {method!r} is not supported yet; supported: "
            f"{supported} (export with `compress run` to convert)"
        )
    raise ArtifactError(
        f"{config_path}: quant_method {method!r} is not supported; supported: {supported}"
    )


def load_model(
    path_or_id: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    verify: str = "strict",
) -> LoadedModel:
    """Load an artifact folder, a plain HF checkpoint folder, a hub id or a GGUF checkpoint
    (a .gguf file, a folder holding one, `pkg:<module>`: runtime/loading/gguf.py `resolve_model`).

    dtype: None keeps the checkpoint's dtype. verify: "strict" (a slimserve artifact needs a
    matching slimserve.json; plain checkpoints load unchecked) or "none" (no manifest check).
    Raises ArtifactError for a missing path, a missing or mismatched manifest, a file outside the
    folder, config values the weight files contradict, an unsupported quant_method, or
    missing/unexpected tensors.
    """
    path_or_id = resolve_model(path_or_id)
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not os.path.lexists(config_path):
            raise _missing(str(path_or_id))
        manifest = check_folder(path, verify)
        qc = read_quant_config(
            path
        )  # config.json's block, else quantize_config.json / quant_config.json
        if qc:
            check_quant_method(qc, config_path)
            skip = (
                manifest or unverified_manifest(path) or ArtifactManifest("")
            ).kv_cache_skip_layers
            model = _load_ct(path, qc, _dtype(dtype), trust_remote_code, skip)
            return _finish(model, path, manifest, True, device, trust_remote_code)
        model = _from_pretrained(str(path), _dtype(dtype), trust_remote_code)
        return _finish(model, path, manifest, False, device, trust_remote_code)
    if path.exists() or not _HUB_ID.match(str(path_or_id)):
        raise _missing(str(path_or_id))
    try:
        model = _from_pretrained(str(path_or_id), _dtype(dtype), trust_remote_code)
    except OSError as e:
        raise _missing(str(path_or_id), e) from e
    return _finish(model, str(path_or_id), None, False, device, trust_remote_code)


@dataclass(slots=True)
class SkeletonModel:
    """A model whose decoder layers stay on disk until asked for (runtime/loading/lazy_weights.py)."""

    model: (
        nn.Module
    )  # HF causal LM, eval mode: tensors outside `layers` loaded, the layers' on meta
    tokenizer: object | None  # HF tokenizer, or None when the folder has none
    checkpoint: CheckpointTensors  # every tensor of the folder, read on demand
    dtype: torch.dtype  # the checkpoint's dtype: the loaded tensors are in it


def load_skeleton(
    path: str | Path, layers: str, verify: str = "strict", trust_remote_code: bool = False
) -> SkeletonModel:
    """A local unquantized safetensors checkpoint as a model skeleton (`empty_model`) holding only
    the tensors outside the module list at `layers` (e.g. 'model.layers'), in the checkpoint's
    dtype; decoder layers are read later, one at a time (compress/layer_store.py).

    The folder gets the checks `load_model` makes (confinement, manifest, config bounds). Raises
    ArtifactError for a folder that is not such a checkpoint (no folder, quantized, or tensor
    names that are not the model's own, as in a checkpoint only transformers' key renaming reads).
    """
    path = Path(resolve_model(path)).expanduser()
    if not path.is_dir() or not os.path.lexists(path / "config.json"):
        raise _missing(str(path))
    check_folder(path, verify)
    if read_quant_config(path):
        raise ArtifactError(
            f"{path} is quantized; layer-by-layer loading reads unquantized checkpoints"
        )
    checkpoint = CheckpointTensors(path)
    dtype = checkpoint.dtype() or torch.float32
    config = load_config(path, trust_remote_code)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = empty_model(config, dtype, trust_remote_code)
    unfuse_experts(model)  # checkpoints hold one Linear per expert (runtime/loading/moe_experts.py)
    names = state_names(model)
    missing = sorted(k for k in names if k not in checkpoint)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ArtifactError(
            f"{path}: the weight files have no tensor {missing[0]}{more} under the model's "
            "own names; load it whole (load_model) instead"
        )
    inside = layers + "."
    assign(model, checkpoint.read([k for k in names if not k.startswith(inside)]))
    model.tie_weights()  # assign replaced the tied parameter: tie its aliases to the loaded one again
    if hasattr(model.config, MARKER_KEY):
        delattr(model.config, MARKER_KEY)
    return SkeletonModel(model, _tokenizer(path, trust_remote_code), checkpoint, dtype)


def load_config(path_or_id: str | Path, trust_remote_code: bool = False):
    """The transformers config of a model folder or hub id, without reading any weights (for the
    checks that run before any work). A local folder's config.json must be a regular file inside it."""
    from transformers import AutoConfig

    path = Path(path_or_id).expanduser()
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):
            raise _missing(str(path_or_id))
        read_config_json(path)  # confined: no symlink out of the folder
    elif path.exists() or not _HUB_ID.match(str(path_or_id)):
        raise _missing(str(path_or_id))
    try:
        return AutoConfig.from_pretrained(str(path_or_id), trust_remote_code=trust_remote_code)
    except OSError as e:
        raise _missing(str(path_or_id), e) from e
    except ValueError as e:  # e.g. a model_type this transformers does not know
        raise ArtifactError(
            f"{path_or_id}: transformers cannot read its config ({str(e).splitlines()[0]})"
        ) from None


def check_folder(path: Path, verify: str) -> ArtifactManifest | None:
    """Everything checked before a byte is allocated: config.json and the weight files are
    regular files inside `path`, the manifest policy (`check_artifact`), and config.json's shape
    values against the safetensors headers. Returns the verified manifest (or None)."""
    config = read_config_json(path)
    manifest = check_artifact(path, verify, config)
    check_config_bounds(config, tensor_shapes(path, weight_files(path)), str(path))
    return manifest


def _from_pretrained(name: str, dtype: torch.dtype | None, trust_remote_code: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        name, dtype=dtype or "auto", trust_remote_code=trust_remote_code, use_safetensors=True
    )


def _finish(
    model: nn.Module, source, manifest, quantized: bool, device, trust_remote_code
) -> LoadedModel:
    model = model.to(device).eval()
    if hasattr(model.config, MARKER_KEY):  # a re-saved copy is not the verified artifact
        delattr(model.config, MARKER_KEY)
    return LoadedModel(model, _tokenizer(source, trust_remote_code), manifest, quantized)


def _tokenizer(source: Path | str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    if isinstance(source, Path) and not has_tokenizer(source):
        return None
    return AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)


def _load_ct(
    path: Path,
    qc: dict,
    dtype: torch.dtype | None,
    trust_remote_code: bool,
    kv_skip_layers: list[int] = (),
) -> nn.Module:
    """Build the HF architecture, swap targeted Linears for QuantLinear, load tensors strictly;
    with fp8 K/V scales, attend over fp8 K/V except in `kv_skip_layers` (the manifest's)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")  # keep transformers' CT quantizer out of it
    with no_init_weights():  # storage is allocated but not initialized: every tensor is loaded
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype or config.dtype, trust_remote_code=trust_remote_code
        )
    model.tie_weights()  # no_init_weights also skips the tying that init_weights does
    unfuse_experts(model)  # artifacts hold one Linear per expert (runtime/loading/moe_experts.py)
    qc, tensors = import_checkpoint(qc, read_safetensors(path), path)  # gptq/awq -> CT buffers
    replace_linears(model, qc)
    kv_scales = pop_kv_scales(model, qc, tensors, path)
    load_state_strict(model, tensors, path)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            m.storage_dtype = tensors[f"{name}.weight_scale"].dtype
    if kv_scales:
        # attention fake-quantizes K/V to fp8 with these scales, except in the skipped layers
        install_kv_scales(model, kv_scales, kv_skip_layers)
    return model


def pop_kv_scales(
    model: nn.Module, qc: dict, tensors: dict[str, torch.Tensor], path: Path
) -> dict[str, tuple[float, float]]:
    """Take the `<attn>.k_scale`/`v_scale` tensors out of `tensors` when kv_cache_scheme is set.

    Returns attention module name -> (k_scale, v_scale); {} without a kv_cache_scheme. Only static
    per-tensor fp8 scales are supported, and every attention module must have both.
    """
    scheme = qc.get("kv_cache_scheme")
    if not scheme:
        return {}
    kind = (
        scheme.get("num_bits", 8),
        scheme.get("type", "int"),
        scheme.get("strategy") or "tensor",
        scheme.get("dynamic", False),
    )
    if kind != (8, "float", "tensor", False):
        raise ArtifactError(
            f"{path}: kv_cache_scheme {scheme} is not supported; supported: static fp8 "
            "per-tensor scales (num_bits 8, type float, strategy tensor, dynamic false)"
        )
    attention = [
        n for n, m in model.named_modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj")
    ]
    scales: dict[str, tuple[float, float]] = {}
    for name in attention:
        pair = []
        for kv in ("k_scale", "v_scale"):
            t = tensors.pop(f"{name}.{kv}", None)
            if t is None or t.numel() != 1 or not t.is_floating_point():
                got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ArtifactError(
                    f"{path}: {name}.{kv} is {got}; config.json has a kv_cache_scheme, "
                    "which needs one float scale [1] per attention module (re-export)"
                )
            pair.append(t.float().item())
        scales[name] = (pair[0], pair[1])
    return scales


def replace_linears(model: nn.Module, qc: dict) -> int:
    """Replace every Linear targeted by a config group (and not ignored) by a QuantLinear.

    Returns the number replaced. The first matching group wins, as in compressed-tensors.
    """
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        try:
            scheme = scheme_from_ct_dict(group)
        except (SchemeError, KeyError, TypeError, ValueError) as e:
            raise ArtifactError(
                f"quantization_config.config_groups.{gname} is not a supported scheme: {e}"
            ) from None
        fmt = group.get("format") or qc.get("format")
        groups.append((gname, group.get("targets") or [], scheme, fmt))
    ignore = qc.get("ignore") or []
    targets = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not matches(n, m, ignore)
    ]
    count = 0
    for name, linear in targets:
        hit = next((g for g in groups if matches(name, linear, g[1])), None)
        if hit is None:
            continue
        gname, _, scheme, fmt = hit
        try:
            q = _quant_linear(linear, scheme, fmt)
        except ValueError as e:
            raise ArtifactError(f"{name} (config group {gname}): {e}") from None
        model.set_submodule(name, q)
        count += 1
    return count


def _quant_linear(linear: nn.Linear, scheme: QuantScheme, fmt: str) -> QuantLinear:
    return QuantLinear(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        scheme,
        fmt,
        dtype=linear.weight.dtype,
        device=linear.weight.device,
    )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of an artifact: files from model.safetensors.index.json, else every
    *.safetensors; each must be a regular file inside `path` (`weight_files`)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        part = load_file(str(path / f))
        dup = sorted(set(part) & set(tensors))
        if dup:
            raise ArtifactError(f"tensor {dup[0]} appears in more than one weight file ({f})")
        tensors.update(part)
    return tensors


def load_state_strict(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Copy `tensors` into the model; any missing, unexpected or mis-typed tensor is an error.

    A parameter tied to one that is present (e.g. lm_head -> embed_tokens) may be absent.
    """
    expected = model.state_dict()
    for key, t in tensors.items():
        want = expected.get(key)
        if want is None:
            continue
        both_float = t.is_floating_point() and want.is_floating_point()  # floats cast to dtype
        if t.shape != want.shape or (t.dtype != want.dtype and not both_float):
            raise ArtifactError(
                f"{path}: tensor {key} has {t.dtype} {tuple(t.shape)}, the model "
                f"expects {want.dtype} {tuple(want.shape)}; the artifact does not "
                "match its config.json"
            )
    aliases: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(n)
    tied_ok = {n for names in aliases.values() if names & tensors.keys() for n in names}
    missing = sorted(k for k in expected if k not in tensors and k not in tied_ok)
    unexpected = sorted(k for k in tensors if k not in expected)
    for label, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
            raise ArtifactError(
                f"{path}: {label} tensor(s) {', '.join(keys[:8])}{more}; the weight "
                "files do not match config.json (re-export the artifact)"
            )
    model.load_state_dict(tensors, strict=False)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and m.ct_format == "pack-quantized":
            if m.weight_shape.tolist() != [m.out_features, m.in_features]:
                raise ArtifactError(
                    f"{path}: {name}.weight_shape is {m.weight_shape.tolist()}, the "
                    f"config says [{m.out_features}, {m.in_features}]"
                )
