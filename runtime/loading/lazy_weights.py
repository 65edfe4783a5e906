"""Build a model without its weights and read its tensors from safetensors one group at a time.

A model larger than memory is compressed layer by layer (compress/layer_store.py): its module
tree is built with every parameter on the meta device (`empty_model`: shapes only, while buffers
computed at construction, such as rotary frequency tables, are real), the tensors outside the
decoder layers are loaded once, and each decoder layer's tensors are read from the checkpoint
when that layer is needed and dropped (back to meta) after it.

Tensors are read with plain positioned reads from the files' headers (`CheckpointTensors`), not
through a memory map, so a tensor's bytes are resident only while a tensor holds them: pages of
a mapped file, once touched, stay in the process's resident set until it unmaps the file, and
would make the resident set grow with every layer read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slimserve.runtime.artifact.weights import weight_files
from slimserve.runtime.errors import ArtifactError

# safetensors dtype names -> torch dtypes (the safetensors format's own table)
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the safetensors format's own limit on the JSON header


@dataclass(frozen=True, slots=True)
class TensorEntry:
    file: Path  # the safetensors file holding the tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in `file`
    nbytes: int


def read_header(file: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Name -> TensorEntry and the `__metadata__` of one safetensors file; ArtifactError naming
    the file when the header is not a valid safetensors header."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ArtifactError(
                f"{file} is not a safetensors file (shorter than its header length)"
            )
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise ArtifactError(f"{file} is not a readable safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{file} is not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{file} is not a readable safetensors file (header is not an object)")
    meta = header.pop("__metadata__", None) or {}
    entries: dict[str, TensorEntry] = {}
    base = 8 + n
    for name, info in header.items():
        try:
            dtype, shape = ST_DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(
                f"{file}: tensor {name} has an unreadable header entry {info!r}"
            ) from None
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if min(shape, default=0) < 0 or end - begin != nbytes or begin < 0 or base + end > size:
            raise ArtifactError(
                f"{file}: tensor {name} {info['dtype']} {list(shape)} does not fit its "
                f"data offsets {[begin, end]}; the file is damaged"
            )
        entries[name] = TensorEntry(file, dtype, shape, base + begin, nbytes)
    return entries, meta


def read_tensors(entries: list[tuple[str, TensorEntry]]) -> dict[str, torch.Tensor]:
    """The named tensors, each read into its own CPU allocation (one open per file, in offset order)."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, TensorEntry]]] = {}
    for name, e in entries:
        by_file.setdefault(e.file, []).append((name, e))
    for file, items in by_file.items():
        with open(file, "rb", buffering=0) as f:
            for name, e in sorted(items, key=lambda it: it[1].start):
                t = torch.empty(e.shape, dtype=e.dtype)
                if e.nbytes:
                    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    f.seek(e.start)
                    done = 0
                    while done < e.nbytes:
                        got = f.readinto(view[done:])
                        if not got:
                            raise ArtifactError(f"{file}: tensor {name} is truncated")
                        done += got
                out[name] = t
    return out


class CheckpointTensors:
    """The tensors of a checkpoint folder, read on demand (headers are read once, up front).

    The files are those `weight_files` lists (model.safetensors.index.json, else every
    *.safetensors; each confined to the folder)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries: dict[str, TensorEntry] = {}
        for f in weight_files(self.path):
            entries, _ = read_header(self.path / f)
            dup = sorted(entries.keys() & self.entries.keys())
            if dup:
                raise ArtifactError(f"tensor {dup[0]} appears in more than one weight file ({f})")
            self.entries.update(entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self):
        return self.entries.keys()

    def dtype(self) -> torch.dtype | None:
        """The dtype most floating-point bytes are stored in (the checkpoint's dtype)."""
        weight: dict[torch.dtype, int] = {}
        for e in self.entries.values():
            if e.dtype.is_floating_point:
                weight[e.dtype] = weight.get(e.dtype, 0) + e.nbytes
        return max(weight, key=weight.get) if weight else None

    def read(self, names) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.entries]
        if missing:
            raise ArtifactError(f"{self.path}: the weight files have no tensor {missing[0]}")
        return read_tensors([(n, self.entries[n]) for n in names])


@contextmanager
def _parameters_on_meta():
    """Every parameter registered in the block is replaced by a meta tensor of its shape and dtype
    (buffers are untouched), so building a module tree allocates no weight memory."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(config, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The transformers causal LM of `config` in `dtype`, eval mode, every parameter on the meta
    device (tied parameters tied); buffers built at construction are real CPU tensors."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    model.tie_weights()
    return model.eval().requires_grad_(False)


def state_names(module: nn.Module) -> dict[str, tuple[nn.Module, str, bool]]:
    """Local state-dict name -> (owning module, attribute, is_parameter) of `module`'s parameters
    and persistent buffers, each once (a tied parameter under its first name)."""
    names: dict[str, tuple[nn.Module, str, bool]] = {}
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                names[prefix + attr] = (mod, attr, True)
        for attr, b in mod._buffers.items():
            if b is not None and attr not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                names[prefix + attr] = (mod, attr, False)
    return names


def assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put `tensors` (local state-dict names, see `state_names`) into `module` as its parameters
    and persistent buffers, replacing what is there (meta or real); ArtifactError for a shape
    that differs from the module's."""
    names = state_names(module)
    for key, t in tensors.items():
        if key not in names:
            raise ArtifactError(f"tensor {key} has no place in {type(module).__name__}")
        mod, attr, is_param = names[key]
        old = mod._parameters[attr] if is_param else mod._buffers[attr]
        if tuple(old.shape) != tuple(t.shape):
            raise ArtifactError(
                f"tensor {key} is {list(t.shape)}, the model expects {list(old.shape)}"
            )
        if is_param:
            mod._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[attr] = t


def to_meta(module: nn.Module) -> None:
    """Drop the storage of every parameter and persistent buffer of `module` (shapes and dtypes kept)."""
    for mod, attr, is_param in state_names(module).values():
        if is_param:
            p = mod._parameters[attr]
            mod._parameters[attr] = nn.Parameter(p.data.to("meta"), requires_grad=False)
        else:
            mod._buffers[attr] = mod._buffers[attr].to("meta")


def _libc_trim():
    """glibc's malloc_trim, or None on other C libraries."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def release_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    A layer's tensors below glibc's mmap threshold (which grows up to 32 MiB as large blocks are
    freed) come from the heap, and freeing them leaves holes that the next layer's differently
    sized tensors do not fill exactly: without a trim after each layer, the resident set grew by
    about 1.5 bytes per parameter of every layer loaded (tests/compress/test_lazy_layers.py)."""
    if _TRIM is not None:
        _TRIM(0)


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
