"""Write an artifact's weights one decoder layer at a time (compress/layer_store.py's models).

Each decoder layer's tensors (and then the trunk's: embeddings, final norm, lm_head, fp8 KV
scales) are assembled exactly as for a whole model (`io.artifact_tensors`) while only that layer
is in memory, and saved as a part file; the parts are then concatenated byte for byte into the
artifact's weight files without loading them: one `model.safetensors` when the weights fit in
`MAX_SHARD_BYTES` (what the whole-model path writes), else `model-00001-of-0000N.safetensors`
files and `model.safetensors.index.json` (the layout transformers and vLLM read).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from slimserve.compress.export.io import WEIGHTS_NAME, LinearTensorsFn, artifact_tensors
from slimserve.compress.layer_store import LayerStore, is_meta
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.weights import INDEX_NAME
from slimserve.runtime.loading.lazy_weights import ST_NAMES, read_header, release_memory

MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default shard size ("5GB")
_COPY_CHUNK = 64 * 2**20
# safetensors' dtype enum in declaration order: save_file writes larger (later) dtypes first
_DTYPE_ORDER = (
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
)
PARTS_DIR = ".parts"  # hidden: never part of the artifact (the manifest skips hidden folders)


def all_quantized(
    quantized: dict[str, QuantizedWeight], layers: LayerStore | None
) -> Iterator[tuple[str, QuantizedWeight]]:
    """Every quantized weight with its data: those in memory, then each layer's from its spill."""
    for name, qw in quantized.items():
        if not is_meta(qw):
            yield name, qw
    if layers is not None:
        for i in range(len(layers)):
            yield from layers.quantized_weights(i).items()


def layer_by_layer_weights(
    model: torch.nn.Module,
    layers: LayerStore,
    quantized: dict[str, QuantizedWeight],
    linear_fn: LinearTensorsFn,
    extra: dict[str, torch.Tensor] | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Callable[[Path], None]:
    """The weight writer `io.write_artifact` calls with its temporary folder: the artifact tensors
    of each decoder layer of `layers` (floating tensors in the model's dtype, quantized Linears
    through `linear_fn`), then the rest of `model`, plus `extra` tensors (e.g. `<attn>.k_scale`)
    in the part of the layer they name."""
    extra = dict(extra or {})
    # export casts the skeleton to the storage dtype
    dtype = model.get_input_embeddings().weight.dtype

    def write(folder: Path) -> None:
        parts_dir = folder / PARTS_DIR
        parts_dir.mkdir()
        parts: list[Path] = []
        inside = layers.mapping.layers + "."
        for i in range(len(layers)):
            pre = layers.prefix(i)
            layers.load(i, dtype)
            try:
                tensors = artifact_tensors(
                    model,
                    layers.quantized_weights(i),
                    linear_fn,
                    keys=lambda k, pre=pre: k.startswith(pre),
                )
            finally:
                layers.drop(i)
            tensors.update({k: v for k, v in extra.items() if k.startswith(pre)})
            parts.append(_save_part(tensors, parts_dir, len(parts)))
            del tensors
            release_memory()
        trunk_q = {n: qw for n, qw in quantized.items() if not n.startswith(inside)}
        tensors = artifact_tensors(
            model, trunk_q, linear_fn, keys=lambda k: not k.startswith(inside)
        )
        tensors.update({k: v for k, v in extra.items() if not k.startswith(inside)})
        parts.append(_save_part(tensors, parts_dir, len(parts)))
        del tensors
        concatenate(parts, folder, max_shard_bytes)
        shutil.rmtree(parts_dir)

    return write


def _save_part(tensors: dict[str, torch.Tensor], folder: Path, n: int) -> Path:
    path = folder / f"part-{n:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def concatenate(
    parts: list[Path], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Copy the tensors of safetensors `parts` into `folder` as one `model.safetensors`, or as
    shards of at most `max_shard_bytes` of data (a part is never split) with an index; returns
    the files written. Streams bytes: nothing is loaded."""
    headers = [read_header(p)[0] for p in parts]
    sizes = [sum(e.nbytes for e in h.values()) for h in headers]
    groups: list[list[int]] = [[]]
    for j, size in enumerate(sizes):
        if groups[-1] and sum(sizes[k] for k in groups[-1]) + size > max_shard_bytes:
            groups.append([])
        groups[-1].append(j)
    names = (
        [WEIGHTS_NAME]
        if len(groups) == 1
        else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    )
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups):
        entries = [(key, e) for j in group for key, e in headers[j].items()]
        _write_shard(folder / name, entries)
        weight_map.update({key: name for key, _ in entries})
    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_shard(path: Path, entries) -> None:
    """One safetensors file of `entries` ((name, TensorEntry) pairs), laid out as safetensors'
    own `save_file` lays it out: compact header, data sorted by dtype (`_DTYPE_ORDER`,
    descending) then name, so a model written whole and one written layer by layer give the
    same bytes."""
    entries = sorted(entries, key=lambda kv: (-_DTYPE_ORDER.index(ST_NAMES[kv[1].dtype]), kv[0]))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, e in entries:
        header[key] = {
            "dtype": ST_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        for _, e in entries:
            with open(e.file, "rb") as src:
                src.seek(e.start)
                left = e.nbytes
                while left:
                    chunk = src.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise OSError(f"{e.file} ended early")
                    out.write(chunk)
                    left -= len(chunk)
