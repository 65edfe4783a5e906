"""Layer-sequential calibration: one decoder layer on the compute device at a time.

1. Run the calibration batches through the model up to the first decoder layer and keep that
   layer's inputs (hidden states + the keyword arguments the model passes: rotary embeddings,
   masks) on the CPU.
2. For each layer: move it to the device, let the stage observe and compress it through a
   `LayerContext` (compress/stage.py, the stage contract; `ctx.forward()` replays the cached inputs through the layer, firing whatever
   hooks the stage registered), then replay the inputs through the *compressed* layer to get the
   next layer's inputs, and move the layer back.

Peak memory is one layer plus the cached activations of one layer, whatever the depth, so a
model larger than device memory still compresses. With a `LayerSource` (compress/layer_store.py)
the same holds for host memory: the model is a skeleton and each layer is read from disk for its
turn and handed back after it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from slimserve.compress.mappings import ArchMapping, decoder_layers, mapping_for
from slimserve.compress.moe import all_experts
from slimserve.compress.stage import (
    CompressionState,
    LayerContext,
    LayerInputs,
    Stage,
    StopForward,
    to_device,
)
from slimserve.runtime.dtypes import DTYPES


def capture_first_layer_inputs(
    model: nn.Module,
    mapping: ArchMapping,
    batches: list[torch.Tensor],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> LayerInputs:
    """Inputs of decoder layer 0 for each batch of token ids [b, seq_len].

    dtype: the dtype the input embeddings' output is cast to before anything reads it (so the
    hidden states, rotary tables and masks are built in it), e.g. float32 for a model whose
    embeddings are held in bf16 (compress/layer_store.py); None leaves the model's own.
    """
    layers = decoder_layers(model, mapping)
    cached = LayerInputs([], [])

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kw = {
            k: v
            for k, v in kwargs.items()
            if k not in ("past_key_values", "past_key_value", "use_cache")
        }
        cached.hidden.append(hidden.detach().cpu())
        cached.kwargs.append(to_device(kw, torch.device("cpu")))
        raise StopForward

    move_trunk(model, mapping.layers, device)
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    handles = [handle]
    if dtype is not None:
        handles.append(
            model.get_input_embeddings().register_forward_hook(
                lambda _m, _args, out: out.to(dtype) if out.is_floating_point() else out
            )
        )
    try:
        with torch.no_grad():
            for ids in batches:
                try:
                    model(input_ids=ids.to(device), use_cache=False)
                except StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
    return cached


@contextmanager
def layer_on_device(layer: nn.Module, device: torch.device, dtype: torch.dtype | None):
    """The layer on `device` (in `dtype`) for the block, then back in its CPU storage.

    Each floating tensor gets a working copy and its original storage is kept and written back
    at the end: moving or casting the layer back and forth would free and reallocate every
    layer's weights, and the allocator's fragmentation then made working memory grow with depth
    (eval/bench_memory.py with bf16 replays; docs/results-quality.md has the numbers).
    """
    if device.type == "cpu" and dtype is None:
        yield
        return
    tensors = [t for t in list(layer.parameters()) + list(layer.buffers()) if t.is_floating_point()]
    originals = [t.data for t in tensors]
    home = originals[0].dtype if originals else torch.float32
    for t, orig in zip(tensors, originals):
        t.data = orig.to(device=device, dtype=dtype or orig.dtype)
    try:
        yield
    finally:
        for t, orig in zip(tensors, originals):
            orig.copy_(t.data)
            t.data = orig
        known = {id(t) for t in tensors}
        for mod in layer.modules():  # buffers a stage registered meanwhile (kv_cache's k/v scales)
            for name, b in mod._buffers.items():
                if b is not None and id(b) not in known and b.is_floating_point():
                    mod._buffers[name] = b.to(device="cpu", dtype=home)


def replay_dtype(state: CompressionState, stage: Stage, device: torch.device) -> torch.dtype | None:
    """The dtype layer replays run in, None for the model's own (float32).

    `calibration.dtype: auto` replays in the storage dtype for stages that only collect input
    statistics (`replay_in_storage_dtype`, e.g. GPTQ's Hessians): bf16 anywhere, fp16 on CUDA
    only (slow on CPUs); stages that compare candidate outputs (AWQ, SmoothQuant) stay float32.
    An explicit dtype applies to every layerwise stage.
    """
    name = state.calibration_dtype
    if name == "auto":
        if not stage.replay_in_storage_dtype:
            return None
        dtype = state.storage_dtype
        if dtype == torch.float16 and device.type != "cuda":
            return None
    else:
        dtype = DTYPES[name]
    return None if dtype == torch.float32 else dtype


def move_trunk(model: nn.Module, layers_path: str, device: torch.device) -> None:
    """Embeddings, rotary tables and the rest of the trunk go to `device`; decoder layers stay put."""
    for name, mod in model.named_modules():
        if name == layers_path or name.startswith(layers_path + "."):
            continue
        for _key, p in mod.named_parameters(recurse=False):
            p.data = p.data.to(device)
        for key, b in mod.named_buffers(recurse=False):
            mod._buffers[key] = b.to(device)


class LayerSource(Protocol):
    """Where decoder layers come from when the model does not hold them (compress/layer_store.py)."""

    def load(self, i: int) -> nn.Module: ...  # layer i with real tensors in the compute dtype

    def done(self, i: int) -> None: ...  # the stage finished layer i


def run_layerwise(
    state: CompressionState,
    stage: Stage,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    on_layer: Callable[[int, int], None] | None = None,
    source: LayerSource | None = None,
) -> None:
    """Apply a layerwise stage to every decoder layer, feeding each the compressed previous one.

    The one runner of layerwise stages (`Stage.compress_layer`): the pipeline calls it between the
    stage's prepare and finalize.

    Layers run on `device` (default: the recipe's, `state.device`) one at a time; the cached
    activations stay on the CPU and the whole model is back on the CPU afterwards. With `source`
    the model's decoder layers are skeletons: each is loaded from it just before its turn and
    handed back (`done`) after, and the embeddings' output is cast to float32 (the compute dtype)
    whatever dtype the embeddings are held in.
    """
    if state.calibration is None:
        raise RuntimeError("layerwise stages need calibration data; the pipeline builds it first")
    model, device = state.model, torch.device(device) if device is not None else state.device
    mapping = mapping_for(model)
    batches = list(state.calibration.split(batch_size))
    inputs = capture_first_layer_inputs(
        model, mapping, batches, device, torch.float32 if source is not None else None
    )
    dtype = replay_dtype(state, stage, device)
    if dtype is not None:
        inputs = LayerInputs(
            [h.to(dtype) for h in inputs.hidden],
            [to_device(kw, dtype=dtype) for kw in inputs.kwargs],
        )
    layers = decoder_layers(model, mapping)
    try:
        for i in range(len(layers)):
            layer = source.load(i) if source is not None else layers[i]
            with layer_on_device(layer, device, dtype):
                ctx = LayerContext(
                    i, f"{mapping.layers}.{i}", layer, inputs, mapping, state, device
                )
                with all_experts(layer, stage.calibrate_all_experts):
                    stage.compress_layer(ctx)
                inputs = LayerInputs(
                    ctx.outputs if ctx.outputs is not None else ctx.forward(), inputs.kwargs
                )
            if source is not None:
                source.done(i)
            if on_layer:
                on_layer(i + 1, len(layers))
    finally:
        move_trunk(model, mapping.layers, torch.device("cpu"))
