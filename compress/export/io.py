"""Write an artifact folder atomically: config.json, model.safetensors, tokenizer, slimserve.json.

Everything is written into a temporary sibling folder, given the user's umask modes (0644 files,
0755 folders under umask 022), fsynced and moved into place with `os.replace` only once complete,
so a crash never leaves a folder that looks like a finished artifact. An existing output folder is
replaced only when it is an earlier artifact (holds slimserve.json) or empty (`replace_problem`).
The writing is format-neutral (`write_artifact`, `artifact_tensors`); each on-disk format only
supplies its per-Linear tensors and its `quantization_config` block (see formats.py). What an
export is given, whatever the format, is defined once: `ExportOptions`, passed through.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from slimserve.compress.moe import dense_modules
from slimserve.runtime.artifact.compressed_tensors import (
    kv_cache_scheme,
    kv_tensors,
    linear_tensors,
    quantization_config,
)
from slimserve.runtime.artifact.manifest import (
    MANIFEST_NAME,
    MARKER_KEY,
    ArtifactManifest,
    artifact_file_hashes,
    write_manifest,
)
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantScheme
from slimserve.runtime.errors import ArtifactError

WEIGHTS_NAME = "model.safetensors"
# module name, its QuantizedWeight -> the tensors that replace `<name>.weight` on disk
LinearTensorsFn = Callable[[str, QuantizedWeight], dict[str, torch.Tensor]]
# called with the finished temporary folder just before it is fsynced and moved into place
BeforeMoveFn = Callable[[Path], Path | None]
# writes an artifact's weight files into the (temporary) folder it is given
WeightsWriter = Callable[[Path], None]
FAILED_SUFFIX = ".failed"  # where a run whose gate failed writes its artifact: `<output>.failed`


def size_bytes(directory: str | Path) -> int:
    """Total bytes of the *.safetensors files in `directory`."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """What an export writes, whatever the format: the arguments of `export_compressed_tensors`
    and `formats.export_artifact`, defined once (a new one is a field here). Those functions take
    one ExportOptions, or its fields as arguments (`ExportOptions.of`)."""

    model: torch.nn.Module  # HF causal LM whose quantized Linears hold fake-quantized weights
    tokenizer: Any  # saved with `save_pretrained`; may be None
    quantized: dict[str, QuantizedWeight]  # module name -> its QuantizedWeight; {}: dense
    out_dir: Path  # where the artifact goes (free, empty or an earlier artifact: `replace_problem`)
    manifest: ArtifactManifest  # written as slimserve.json, with the files' hashes filled in
    # module name -> full scheme (for input activations, e.g. W8A8); default: weight-only
    # `QuantScheme(qw.args)`
    schemes: dict[str, QuantScheme] | None = None
    # attention module name -> static fp8 (k_scale, v_scale); written as `<attn>.k_scale`/`.v_scale`
    # [1] in the model dtype with a `kv_cache_scheme` block
    kv_scales: dict[str, tuple[float, float]] | None = None
    # called with the finished temporary folder just before it is moved into place; a Path it
    # returns is where the folder goes instead of out_dir (checked with `replace_problem` too)
    before_move: BeforeMoveFn | None = None

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> ExportOptions:
        """One ExportOptions passed as it is, or one made of its fields: positional in field
        order (model, tokenizer, quantized, out_dir, manifest, ...) and/or by name."""
        if len(args) == 1 and not kwargs and isinstance(args[0], cls):
            return args[0]
        return cls(*args, **kwargs)


def export_compressed_tensors(*args: Any, **kwargs: Any) -> Path:
    """Export a model as a compressed-tensors artifact and return its folder.

    Arguments: one `ExportOptions`, or its fields (model, tokenizer, quantized, out_dir,
    manifest, schemes=, kv_scales=, before_move=).
    """
    opts = ExportOptions.of(*args, **kwargs)
    linear_fn, extra, qc = compressed_tensors_plan(opts)
    tensors = artifact_tensors(opts.model, opts.quantized, linear_fn)
    tensors.update(extra)
    return write_artifact(opts, tensors, qc)


def compressed_tensors_plan(
    opts: ExportOptions,
) -> tuple[LinearTensorsFn, dict[str, torch.Tensor], dict | None]:
    """What a compressed-tensors export writes besides the state dict: the per-Linear tensor
    function, the extra tensors (fp8 KV scales) and the `quantization_config` block (None when
    nothing is quantized). Needs only the names, shapes and arguments of `opts.quantized`."""
    model, kv_scales = opts.model, opts.kv_scales
    schemes = {
        n: (opts.schemes or {}).get(n) or QuantScheme(qw.args) for n, qw in opts.quantized.items()
    }
    extra: dict[str, torch.Tensor] = {}
    qc = None
    if schemes or kv_scales:
        linears = linear_classes(model)
        extra = kv_tensors(kv_scales or {}, model.get_input_embeddings().weight.dtype)
        qc = quantization_config(
            {n: schemes[n] for n in linears if n in schemes},
            linears,
            kv_cache_scheme() if kv_scales else None,
        )
    return (lambda n, qw: linear_tensors(n, qw, schemes[n])), extra, qc


def write_artifact(
    opts: ExportOptions,
    tensors: dict[str, torch.Tensor] | WeightsWriter,
    quant_config: dict | None,
    extra_json: dict[str, dict] | None = None,
) -> Path:
    """Write tensors, config.json (+ `quant_config` as its quantization_config), generation
    config, tokenizer, `extra_json` files (name -> dict) and the manifest of `opts`, atomically,
    at `opts.out_dir`.

    `tensors` is the weights as one dict (written as model.safetensors) or a function that
    writes the weight files into the temporary folder (compress/export/shards.py, for a model
    whose layers are on disk). `opts.before_move(folder)` may add files (the run report) to the
    finished temporary folder. An
    existing `out_dir` that is neither an earlier artifact nor empty raises ArtifactError before
    anything is written; it is never deleted.
    """
    model = opts.model
    out_dir = Path(opts.out_dir)
    problem = replace_problem(out_dir)
    if problem:
        raise ArtifactError(problem)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if callable(tensors):
            tensors(tmp)
        else:
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        _write_config(model, tmp, quant_config)
        for name, content in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if opts.tokenizer is not None:
            opts.tokenizer.save_pretrained(tmp)
        # every file written so far (config, tokenizer, chat template, generation config,
        # weights); the report files come after the artifact and are not covered (manifest.py)
        files = artifact_file_hashes(tmp)
        write_manifest(tmp, dataclasses.replace(opts.manifest, files=files))
        if opts.before_move is not None:
            # it may send the artifact elsewhere (a run whose task gate failed: `<output>.failed`)
            out_dir = Path(opts.before_move(tmp) or out_dir)
        _finish_files(tmp)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def failed_output(out_dir: str | Path) -> Path:
    """Where a run whose gate failed writes its artifact, beside (never over) `out_dir`."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + FAILED_SUFFIX)


def replace_problem(out_dir: str | Path) -> str | None:
    """Why an export must not replace `out_dir`, or None when it may: the path is free, an empty
    folder, or an earlier slimserve artifact (a folder holding slimserve.json)."""
    out_dir = Path(out_dir)
    if not os.path.lexists(out_dir):
        return None
    if not out_dir.is_dir():
        return f"{out_dir} exists and is not a folder; choose a new folder for the artifact"
    try:
        if (out_dir / MANIFEST_NAME).is_file() or next(out_dir.iterdir(), None) is None:
            return None
    except OSError as e:
        return f"{out_dir} cannot be read ({e.strerror}); choose a new folder for the artifact"
    return (
        f"{out_dir} is not empty and is not a slimserve artifact (no {MANIFEST_NAME}); export "
        "replaces only an earlier artifact, so choose a new or empty folder"
    )


def _umask() -> int:
    """The process umask, read without changing it where /proc allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        if not directory:
            raise
    finally:
        os.close(fd)


def _finish_files(folder: Path) -> None:
    """Give every file and folder the mode the user's umask gives new ones (mkdtemp makes the
    folder 0700) and fsync them, so what is renamed into place is readable as usual and on disk."""
    mask = _umask()
    for root, dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                os.chmod(path, 0o666 & ~mask)
                _fsync(path)
        for name in dirs:
            os.chmod(Path(root) / name, 0o777 & ~mask)
    for root, _, _ in os.walk(folder, topdown=False):
        _fsync(Path(root), directory=True)
    os.chmod(folder, 0o777 & ~mask)


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder to `out_dir`, replacing an old one only after the new is done,
    and only when it is an earlier artifact or empty (re-checked here: nothing else is deleted)."""
    problem = replace_problem(out_dir)
    if problem:
        raise ArtifactError(problem)
    if not os.path.lexists(out_dir):
        os.replace(tmp, out_dir)
        _fsync(out_dir.parent, directory=True)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, old / out_dir.name)
    os.replace(tmp, out_dir)
    _fsync(out_dir.parent, directory=True)
    shutil.rmtree(old, ignore_errors=True)


def linear_classes(model: torch.nn.Module) -> dict[str, str]:
    """Name -> class name of every nn.Linear (or subclass) in the model, in model order; the
    mixture-of-experts routers (a [E, H] weight in a router module) count as plain `Linear`, so
    the formats list them with the other unquantized Linears (the compressed-tensors `ignore`)
    and every loader, vLLM's included, keeps them dense."""
    dense = dense_modules(model)
    return {
        n: "Linear" if n in dense else type(m).__name__
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) or n in dense
    }


def _write_config(model: torch.nn.Module, folder: Path, quant_config: dict | None) -> None:
    """config.json = the model config (dtype kept) plus `quantization_config` when quantized,
    and the slimserve marker (MARKER_KEY), which tells loaders a manifest must be present."""
    model.config.save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    config[MARKER_KEY] = {"manifest": MANIFEST_NAME}
    if quant_config:
        config["quantization_config"] = quant_config
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def artifact_tensors(
    model: torch.nn.Module,
    quantized: dict[str, QuantizedWeight],
    linear_fn: LinearTensorsFn,
    keys: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor to save: the model's state dict with each quantized `<name>.weight` swapped
    for `linear_fn(name, qw)`; with `keys`, only the state-dict entries it accepts (one decoder
    layer's, compress/export/shards.py), and `quantized` must hold only theirs.

    Tied weights (model.all_tied_weights_keys, e.g. lm_head -> embed_tokens) are written once, as
    save_pretrained does; any other tensors sharing memory are cloned so safetensors accepts them.
    """
    linears = linear_classes(model)
    for name, qw in quantized.items():
        if name not in linears:
            raise ValueError(
                f"quantized module {name!r} is not a Linear of the model; pass module "
                "names as in model.named_modules(), e.g. 'model.layers.0.self_attn.q_proj'"
            )
        weight = model.get_submodule(name).weight
        if tuple(weight.shape) != qw.shape:
            raise ValueError(
                f"{name}: quantized shape {qw.shape} != weight shape {tuple(weight.shape)}"
            )
    skip = {f"{n}.weight" for n in quantized}
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    state = model.state_dict()
    bad = sorted(k for k in skip if k in tied or k in tied.values())
    if bad:
        raise ValueError(
            f"{bad[0]} is tied to another weight and cannot be quantized alone; "
            "ignore that module or untie the embeddings (tie_word_embeddings=false)"
        )
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}  # storage address -> first name written
    for key, t in state.items():
        if key in skip or (keys is not None and not keys(key)):
            continue
        if tied.get(key) in state and _same_view(t, state[tied[key]]):
            continue
        ptr = t.untyped_storage().data_ptr()
        t = t.detach().clone() if ptr in seen else t.detach().contiguous()
        seen.setdefault(ptr, key)
        tensors[key] = t.cpu()
    for name, qw in quantized.items():
        tensors.update({k: v.cpu() for k, v in linear_fn(name, qw).items()})
    return tensors


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
    )
