"""Build our CausalLM from an artifact or HF folder (no transformers model at run time).

Reuses the compressed-tensors loader's rules: folder confinement, checksums from slimserve.json,
config bounds (`check_folder`), quant config from config.json (or a GPTQ/AWQ quantize_config),
GPTQ/AWQ tensors converted to CT buffers, targeted Linears swapped for QuantLinear, fp8 KV
scales popped, strict tensor loading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimserve.runtime.artifact.importers import import_checkpoint, read_quant_config
from slimserve.runtime.artifact.manifest import (
    MANIFEST_NAME,
    ArtifactManifest,
    check_gate,
    unverified_manifest,
)
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.layers.quant_linear import QuantLinear
from slimserve.runtime.loading.loader import (
    check_folder,
    check_quant_method,
    has_tokenizer,
    load_state_strict,
    pop_kv_scales,
    read_safetensors,
    replace_linears,
)
from slimserve.runtime.models.arch import model_class, model_spec
from slimserve.runtime.models.fuse import fuse_projections
from slimserve.runtime.models.llama import CausalLM, ModelSpec


@dataclass
class BuiltModel:
    model: CausalLM  # on the target device, eval mode
    spec: ModelSpec
    tokenizer: object | None  # HF tokenizer (None when the folder has none)
    has_kv_scales: bool  # the artifact carries calibrated fp8 K/V scales
    quantized: bool  # some Linears are QuantLinear
    eos_token_ids: tuple[int, ...]  # config's and generation_config's EOS ids
    dtype: torch.dtype  # compute dtype
    # decoder layers (indices of the whole model, also under a pipeline split) whose KV cache stays
    # unquantized when the others are fp8, int8 or int4: the manifest's kv_cache_skip_layers
    kv_skip_layers: tuple[int, ...] = ()
    # the manifest's kv_cache_dtype ("int8", "int4"): what `--kv-cache-dtype auto` serves; "": none
    kv_cache_dtype: str = ""


def _eos_ids(path: Path, config, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.is_file():
        import json

        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        sources.append(getattr(tokenizer, "eos_token_id", None))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(i) for i in s)
    return tuple(sorted(ids))


def reset_runtime_buffers(model: CausalLM) -> None:
    """Non-persistent buffers (RoPE frequencies, KV scales = 1) after `to_empty`. Both stay
    fp32 through `model.to(dtype)` (llama.Fp32Buffers), so the frequencies are copied exactly."""
    model.inv_freq.copy_(torch.tensor(model.spec.inv_freq, dtype=torch.float32))
    if hasattr(model, "reset_rope_buffers"):  # Gemma 3's local, Phi-3's long frequencies
        model.reset_rope_buffers()
    for layer in model.model.layers:
        layer.self_attn.k_scale.fill_(1.0)
        layer.self_attn.v_scale.fill_(1.0)


def build_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    verify: str = "strict",
    allow_failed_gate: bool = False,
    shard=None,
) -> BuiltModel:
    """Load `path` (artifact or HF checkpoint folder) into our CausalLM on `device` in `dtype`.

    verify: "strict" (a slimserve artifact needs a matching slimserve.json) or "none"; the
    folder confinement and config bounds checks (`check_folder`) run either way.
    allow_failed_gate: load an artifact whose manifest says its perplexity gate failed
    (refused with ArtifactError otherwise, `check_gate`).
    shard: one rank of a tensor-parallel model (`TensorShard`, runtime/distributed/loading.py)
    or one pipeline stage (`StageShard`, runtime/distributed/pipeline.py): its shapes, only its
    tensors or slices of them, its parallel layers; None: the whole model.
    """
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not os.path.lexists(path / "config.json"):
        raise ArtifactError(
            f"{path}: no config.json; pass an artifact made by `compress run` or "
            "a Hugging Face checkpoint folder"
        )
    manifest = check_folder(path, verify) or unverified_manifest(path)
    if not allow_failed_gate:
        check_gate(path, manifest)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    spec = model_spec(config)
    qc = read_quant_config(path)
    tensors = read_safetensors(path) if shard is None else None
    with torch.device("meta"):
        model = model_class(spec)(spec if shard is None else shard.local_spec(spec))
    if shard is not None:  # may drop the modules the shard does not hold (pipeline stages)
        tensors = shard.read(path, model)
    if qc:
        check_quant_method(qc, f"{path}/config.json", convert_hint=False)
        qc, tensors = import_checkpoint(qc, tensors, path)
        replace_linears(model, qc)
        if shard is not None:
            shard.after_replace(model)
    kv_scales = pop_kv_scales(model, qc, tensors, path) if qc else {}
    model = model.to(dtype).to_empty(device=device)
    if (
        spec.tie_word_embeddings
        and model.lm_head is not None
        and model.model.embed_tokens is not None
    ):
        # to_empty gives shared parameters separate storage: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
        tensors.pop("lm_head.weight", None)
    load_state_strict(model, tensors, path)
    reset_runtime_buffers(model)
    quantized = False
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            m.storage_dtype = tensors[f"{name}.weight_scale"].dtype
            quantized = True
    for name, (k, v) in kv_scales.items():
        attn = model.get_submodule(name)
        attn.k_scale.fill_(k)
        attn.v_scale.fill_(v)
    fuse_projections(model)
    if shard is not None:
        shard.parallelize(model)
    tokenizer = (
        AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if has_tokenizer(path) and (shard is None or shard.rank == 0)
        else None
    )
    kv_dtype = _kv_cache_dtype(manifest, bool(kv_scales))
    return BuiltModel(
        model.eval(),
        spec,
        tokenizer,
        bool(kv_scales),
        quantized,
        _eos_ids(path, config, tokenizer),
        dtype,
        _kv_skip_layers(manifest, spec.num_layers) if kv_scales or kv_dtype else (),
        kv_dtype,
    )


ARTIFACT_KV_DTYPES = ("int8", "int4")  # what a manifest's kv_cache_dtype may record


def _kv_cache_dtype(manifest: ArtifactManifest | None, has_kv_scales: bool) -> str:
    """The manifest's kv_cache_dtype, checked: a known name, and not beside fp8 K/V scales (an
    artifact is calibrated for fp8 or asks for an online int cache, not both)."""
    name = manifest.kv_cache_dtype if manifest is not None else ""
    if not name:
        return ""
    if name not in ARTIFACT_KV_DTYPES:
        raise ArtifactError(
            f"{MANIFEST_NAME}: kv_cache_dtype {name!r} is not one of "
            f"{', '.join(ARTIFACT_KV_DTYPES)}; re-export the artifact"
        )
    if has_kv_scales:
        raise ArtifactError(
            f"{MANIFEST_NAME}: kv_cache_dtype {name} with fp8 k/v scales in the checkpoint is "
            "not a supported combination (an int cache computes its own scales); re-export "
            "with one kv_cache stage of dtype fp8_e4m3 or of dtype int8/int4"
        )
    return name


def _kv_skip_layers(manifest: ArtifactManifest | None, num_layers: int) -> tuple[int, ...]:
    """The manifest's kv_cache_skip_layers, checked against the model's layer count."""
    skip = manifest.kv_cache_skip_layers if manifest is not None else []
    bad = [i for i in skip if not (isinstance(i, int) and 0 <= i < num_layers)]
    if bad:
        raise ArtifactError(
            f"{MANIFEST_NAME}: kv_cache_skip_layers {bad} are not layers of this "
            f"{num_layers}-layer model; re-export the artifact"
        )
    return tuple(sorted(set(skip)))


def random_model(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> CausalLM:
    """A randomly initialized dense CausalLM (benchmarks of model shapes we cannot download)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(spec)(spec).to(dtype)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    reset_runtime_buffers(model)
    return model.eval()
