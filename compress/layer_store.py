"""Bounded-memory compression: decoder layers live on disk and come into memory one at a time.

The pipeline (compress/pipeline.py) takes this path when every stage of a recipe is layerwise
(`Stage.layerwise`) and the model is a local, unquantized safetensors checkpoint of an
architecture in compress/mappings.py. The model is then a skeleton (runtime/loading/lazy_weights.py
`empty_model`): the tensors outside the decoder layers (embeddings, final norm, lm_head) are
held in the checkpoint's dtype, and every decoder layer's parameters are on the meta device
except while a stage or an evaluation works on it:

- `load(i)` reads layer i from where its current tensors are (the checkpoint, or the spill file
  the last stage wrote for it) and upcasts its floating tensors to float32, the compute dtype,
  so a stage sees exactly what the whole-model path shows it (a float32 model);
- `done(i)` (calibration.run_layerwise, after the stage's `compress_layer(i)`) marks the layer
  finished; the layer *before* it is then written to a spill file and dropped (`commit`), one
  layer late because a stage may still change the previous layer when the next one starts
  (AWQ restores the unquantized weights it fed forward); `finish()` commits what is left after
  the stage's `finalize`;
- `drop(i)` releases a layer without writing it (evaluation only reads).

A spill file holds the layer's state dict, each floating tensor in the checkpoint's dtype when
that is exact and in float32 otherwise (a smoothing stage's rescaled weights), and the unpacked
`QuantizedWeight` tensors of its quantized Linears. The `CompressionState.quantized` entries of
a committed layer keep their arguments and shapes on the meta device (sizes, partial groups and
format checks need nothing else); `quantized_weights(i)` reads the real ones back for export.

Memory is the trunk, a layer or two in float32, the stage's own working set (Hessians, cached
activations) and whatever the OS caches, whatever the depth. The spill folder needs about the
checkpoint's size on disk (more where a stage leaves float32 weights) and is deleted by `close`.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from slimserve.compress.mappings import ArchMapping
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.loading.lazy_weights import (
    CheckpointTensors,
    TensorEntry,
    assign,
    read_header,
    read_tensors,
    release_memory,
    to_meta,
)

COMPUTE_DTYPE = torch.float32
_Q = "::"  # spill key separator: '<module>::codes' etc. (never in a module name)
_Q_FIELDS = ("codes", "scale", "zero_point", "g_idx")


def meta_qweight(qw: QuantizedWeight) -> QuantizedWeight:
    """`qw` with every tensor on the meta device: its shape, dtypes and arguments, no data."""
    meta = lambda t: None if t is None else t.to("meta")  # noqa: E731
    return dataclasses.replace(
        qw,
        codes=meta(qw.codes),
        scale=meta(qw.scale),
        zero_point=meta(qw.zero_point),
        g_idx=meta(qw.g_idx),
    )


def is_meta(qw: QuantizedWeight) -> bool:
    return qw.codes.device.type == "meta"


class LayerStore:
    """Where each decoder layer of a skeleton model currently lives, and moving it in and out."""

    def __init__(
        self,
        model: nn.Module,
        mapping: ArchMapping,
        checkpoint: CheckpointTensors,
        quantized: dict[str, QuantizedWeight],
        spill_dir: str | Path | None = None,
    ):
        self.model, self.mapping, self.checkpoint = model, mapping, checkpoint
        self.quantized = quantized  # the pipeline state's dict: committed layers hold meta entries
        self.layers = model.get_submodule(mapping.layers)
        self.dtype = checkpoint.dtype() or torch.bfloat16  # the dtype spills use when it is exact
        self._dir = Path(tempfile.mkdtemp(prefix="slimserve-layers-", dir=spill_dir))
        self._spill: dict[int, Path] = {}  # layer -> its latest spill file (absent: the checkpoint)
        self._version = 0
        self._loaded: set[int] = set()
        self._pending: list[int] = []  # finished by the stage, not yet committed

    def prefix(self, i: int) -> str:
        return f"{self.mapping.layers}.{i}."

    def __len__(self) -> int:
        return len(self.layers)

    def _entries(self, i: int) -> list[tuple[str, TensorEntry]]:
        """(local name, entry) of layer i's state-dict tensors where they are now."""
        local = list(self.layers[i].state_dict(keep_vars=True).keys())
        if i in self._spill:
            entries, _ = read_header(self._spill[i])
            return [(k, entries[k]) for k in local if k in entries]
        pre = self.prefix(i)
        return [(k, self.checkpoint.entries[pre + k]) for k in local if pre + k in self.checkpoint]

    def load(self, i: int, dtype: torch.dtype | None = COMPUTE_DTYPE) -> nn.Module:
        """Layer i with real tensors, floating ones in `dtype` (None: as stored); returns it."""
        if i in self._loaded:
            return self.layers[i]
        tensors = read_tensors(self._entries(i))
        if dtype is not None:
            tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
        assign(self.layers[i], tensors)
        self._loaded.add(i)
        return self.layers[i]

    def drop(self, i: int) -> None:
        """Release layer i without writing it (its tensors have not changed)."""
        to_meta(self.layers[i])
        self._loaded.discard(i)
        release_memory()  # else heap fragmentation grows the resident set with every layer

    def done(self, i: int) -> None:
        """The stage finished layer i: commit every finished layer before it."""
        for j in [j for j in self._pending if j < i]:
            self.commit(j)
        self._pending = [j for j in self._pending if j >= i] + [i]

    def finish(self) -> None:
        """After the stage's finalize: commit the layers still held."""
        for j in sorted(self._pending):
            self.commit(j)
        self._pending = []

    def commit(self, i: int) -> None:
        """Write layer i (its state dict and its quantized weights) to a new spill file, then drop it."""
        if i not in self._loaded:
            raise RuntimeError(f"layer {i} is not loaded; load it before committing it")
        pre = self.prefix(i)
        out: dict[str, torch.Tensor] = {}
        for k, t in self.layers[i].state_dict().items():
            t = t.detach().cpu()
            if t.is_floating_point() and t.dtype != self.dtype:
                low = t.to(self.dtype)
                t = low if torch.equal(low.to(t.dtype), t) else t.float()
            out[k] = t.contiguous()
        stale = []  # quantized weights of this layer committed before: carried over from the old spill
        for name, qw in self.quantized.items():
            if not name.startswith(pre):
                continue
            if is_meta(qw):
                stale.append(name)
                continue
            for f in _Q_FIELDS:
                t = getattr(qw, f)
                if t is not None:
                    out[f"{name}{_Q}{f}"] = t.detach().cpu().contiguous()
        if stale:
            entries, _ = read_header(self._spill[i])
            wanted = [(k, e) for k, e in entries.items() if k.split(_Q)[0] in stale and _Q in k]
            out.update(read_tensors(wanted))
        self._version += 1
        path = self._dir / f"layer-{i:05d}-{self._version}.safetensors"
        save_file(out, str(path))
        old = self._spill.get(i)
        self._spill[i] = path
        if old is not None:
            old.unlink(missing_ok=True)
        for name, qw in list(self.quantized.items()):
            if name.startswith(pre) and not is_meta(qw):
                self.quantized[name] = meta_qweight(qw)
        self.drop(i)

    def quantized_weights(self, i: int) -> dict[str, QuantizedWeight]:
        """The quantized weights of layer i's Linears with their data (read from its spill)."""
        pre = self.prefix(i)
        names = [n for n in self.quantized if n.startswith(pre)]
        if not names:
            return {}
        entries, _ = read_header(self._spill[i])
        data = read_tensors(
            [(k, e) for k, e in entries.items() if _Q in k and k.split(_Q)[0] in names]
        )
        out = {}
        for n in names:
            fields = {f: data.get(f"{n}{_Q}{f}") for f in _Q_FIELDS}
            out[n] = dataclasses.replace(self.quantized[n], **fields)
        return out

    def close(self) -> None:
        """Delete the spill files."""
        shutil.rmtree(self._dir, ignore_errors=True)
        self._spill.clear()
